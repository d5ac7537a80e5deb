//! The backend seam: what a connected peer must do to move a validated transfer, and the
//! shared state a transfer's future, its cancel handle and the backend's tasks meet at.
//!
//! Every backend passes the conformance suite in `transfer/tests/conformance.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::descriptor::Op;
use crate::error::{Result, TransferError};
use crate::metadata::TOKEN_BYTES;
use crate::region::{RegionMem, Registry};

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod frame;
pub mod quic;
pub(crate) mod shm;
pub(crate) mod stream;
pub(crate) mod tcp;
#[cfg(feature = "ucx")]
pub(crate) mod ucx;

/// Which backend a peer connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// Same-host shared memory: the initiator maps the peer's regions and copies.
    Shm,
    /// TCP: several parallel streams, transfers striped over them.
    Tcp,
    /// QUIC (quinn, TLS 1.3, the peer's certificate pinned from its metadata).
    Quic,
    /// UCX (feature `ucx`): RMA put/get with the transports UCX finds.
    Ucx,
    /// CUDA (feature `cuda`): copies on a stream between agents of one process.
    Cuda,
}

impl BackendKind {
    /// The backend's name as used in errors and reports.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Shm => "shm",
            BackendKind::Tcp => "tcp",
            BackendKind::Quic => "quic",
            BackendKind::Ucx => "ucx",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A notification a peer attached to a transfer, delivered after the transfer's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name (as it presented itself).
    pub from: String,
    pub message: Vec<u8>,
}

/// What the target side of every backend needs.
pub(crate) struct TargetCtx {
    pub name: String,
    pub token: [u8; TOKEN_BYTES],
    pub registry: Arc<Registry>,
    pub notifications: mpsc::Sender<Notification>,
    /// Set when the agent shuts down (backends that bypass sockets check it).
    pub closed: std::sync::atomic::AtomicBool,
}

/// One validated, merged range of a transfer.
pub(crate) struct Segment {
    pub local: Arc<RegionMem>,
    pub local_offset: u64,
    pub remote: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// `RegionNotFound` if any local region of `segments` was deregistered meanwhile.
pub(crate) fn check_local_live(segments: &[Segment]) -> Result<()> {
    segments.iter().try_for_each(|s| s.local.check_live())
}

/// A validated transfer handed to a backend.
pub(crate) struct Job {
    pub op: Op,
    pub segments: Vec<Segment>,
    pub notification: Option<Vec<u8>>,
    pub ctl: Arc<TransferCtl>,
}

pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;

/// A connection to one peer over one backend.
pub(crate) trait PeerBackend: Send + Sync + 'static {
    /// Runs `job` to completion: all bytes moved, then the notification (if any) delivered.
    /// The future checks `job.ctl` for cancellation before posting each chunk and before the
    /// notification, and returns `Cancelled` when it stops for that reason.
    fn execute(self: Arc<Self>, job: Job) -> BoxFuture;

    /// Whether [`TransferCtl::settled`] tells when no piece of a transfer can touch local
    /// memory any more (the stream backends count their pieces; the others do not).
    fn tracks_pieces(&self) -> bool {
        false
    }

    /// Fails every transfer in flight on this peer and stops its connections' tasks
    /// (a peer that hangs). Later posts fail. Default: nothing to stop.
    fn close(&self) {}
}

/// One piece of a transfer that may still read or write local memory (a request in a
/// stream lane's queue or waiting for its reply): counted in the transfer's
/// [`TransferCtl`] while it lives.
pub(crate) struct Piece(Arc<TransferCtl>);

impl Piece {
    pub(crate) fn new(ctl: &Arc<TransferCtl>) -> Self {
        ctl.pieces.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(ctl))
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        if self.0.pieces.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.settle.notify_waiters();
        }
    }
}

/// State shared by a transfer's future, its cancel handles and the backend's tasks.
pub(crate) struct TransferCtl {
    pub id: u64,
    cancelled: AtomicBool,
    remaining: AtomicUsize,
    error: Mutex<Option<TransferError>>,
    pub wake: tokio::sync::Notify,
    /// Live [`Piece`]s, and their last one's going.
    pieces: AtomicUsize,
    settle: tokio::sync::Notify,
}

impl TransferCtl {
    pub(crate) fn new(id: u64) -> Self {
        Self {
            id,
            cancelled: AtomicBool::new(false),
            remaining: AtomicUsize::new(0),
            error: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
            pieces: AtomicUsize::new(0),
            settle: tokio::sync::Notify::new(),
        }
    }

    /// Resolves once no [`Piece`] of the transfer lives.
    pub(crate) async fn settled(&self) {
        loop {
            let notified = self.settle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.pieces.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    pub(crate) fn cancelled_error(&self) -> TransferError {
        TransferError::Cancelled {
            transfer_id: self.id,
        }
    }

    /// Returns `Cancelled` if the transfer was cancelled.
    pub(crate) fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            Err(self.cancelled_error())
        } else {
            Ok(())
        }
    }

    pub(crate) fn add_outstanding(&self, n: usize) {
        self.remaining.fetch_add(n, Ordering::AcqRel);
    }

    /// One outstanding piece finished.
    pub(crate) fn complete_one(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.wake.notify_one();
        }
    }

    /// One outstanding piece failed; the first error is kept.
    pub(crate) fn fail(&self, err: TransferError) {
        {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(err);
            }
        }
        self.remaining.fetch_sub(1, Ordering::AcqRel);
        self.wake.notify_one();
    }

    fn take_error(&self) -> Option<TransferError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Waits until every outstanding piece finished (or one failed, or, when `honour_cancel`,
    /// the transfer was cancelled).
    pub(crate) async fn wait_outstanding(&self, honour_cancel: bool) -> Result<()> {
        loop {
            if let Some(e) = self.take_error() {
                return Err(e);
            }
            if self.remaining.load(Ordering::Acquire) == 0 {
                return Ok(());
            }
            if honour_cancel {
                self.check()?;
            }
            // `notify_one` stores a permit when nobody waits, so no wake-up is lost between
            // the checks above and this await.
            self.wake.notified().await;
        }
    }
}
