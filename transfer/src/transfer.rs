//! A posted transfer: a future with completion, cancellation and telemetry.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::backend::{BoxFuture, TransferCtl};
use crate::descriptor::Op;
use crate::error::Result;

/// Telemetry of one completed transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferStats {
    pub op: Op,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Descriptors after merging adjacent ones.
    pub descriptors: usize,
    /// Time spent in `post` (validation, merging, building the future).
    pub post_time: Duration,
    /// Time from the end of `post` to completion (includes the notification's delivery).
    pub transfer_time: Duration,
}

/// A posted transfer. Await it for the outcome; it moves bytes only while polled.
///
/// Cancelling (with [`cancel`](Self::cancel), a [`CancelHandle`], or by dropping the
/// future) stops it from posting further chunks; awaiting it then yields `Cancelled`, and the
/// peer gets no notification for it. Chunks already handed to the transport may still land,
/// so the destination bytes are unspecified after a cancellation.
pub struct Transfer {
    ctl: Arc<TransferCtl>,
    fut: BoxFuture,
    op: Op,
    bytes: u64,
    descriptors: usize,
    post_time: Duration,
    posted: Instant,
    /// Whether its backend counts pieces ([`Transfer::settle_handle`]).
    settles: bool,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("id", &self.ctl.id)
            .field("op", &self.op)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// Tells when no piece of a transfer can touch local memory any more (see
/// [`Transfer::settle_handle`]).
#[derive(Clone)]
pub struct SettleHandle {
    ctl: Arc<TransferCtl>,
}

impl SettleHandle {
    /// Resolves once every request of the transfer has been answered, failed with its
    /// connection, or dropped unsent: from then on none of its bytes lands in (or is read
    /// from) local memory. A transfer cancelled or dropped while its requests wait on a
    /// peer that hangs settles only when those requests are answered or their connections
    /// closed ([`crate::Peer::close`]).
    pub async fn settled(&self) {
        self.ctl.settled().await
    }
}

impl std::fmt::Debug for SettleHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettleHandle")
            .field("transfer", &self.ctl.id)
            .finish()
    }
}

/// Cancels a transfer from anywhere (another task, a timeout).
#[derive(Clone)]
pub struct CancelHandle {
    ctl: Arc<TransferCtl>,
}

impl CancelHandle {
    /// Requests cancellation.
    pub fn cancel(&self) {
        self.ctl.cancel();
    }
}

impl std::fmt::Debug for CancelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelHandle")
            .field("transfer", &self.ctl.id)
            .finish()
    }
}

impl Transfer {
    pub(crate) fn new(
        ctl: Arc<TransferCtl>,
        fut: BoxFuture,
        op: Op,
        bytes: u64,
        descriptors: usize,
        t0: Instant,
    ) -> Self {
        let posted = Instant::now();
        Self {
            ctl,
            fut,
            op,
            bytes,
            descriptors,
            post_time: posted - t0,
            posted,
            settles: false,
        }
    }

    pub(crate) fn settling(mut self, settles: bool) -> Self {
        self.settles = settles;
        self
    }

    /// A handle that tells when the transfer can no longer touch local memory, even after
    /// it resolved with an error or was cancelled or dropped: the moment a READ's
    /// destination may be reused. `None` on backends that cannot tell (shared memory, UCX,
    /// CUDA); TCP and QUIC can.
    pub fn settle_handle(&self) -> Option<SettleHandle> {
        self.settles.then(|| SettleHandle {
            ctl: Arc::clone(&self.ctl),
        })
    }

    /// This transfer's id (unique within the posting agent).
    pub fn id(&self) -> u64 {
        self.ctl.id
    }

    /// Payload bytes the transfer moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Descriptors after merging.
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }

    /// Requests cancellation (see the type's docs).
    pub fn cancel(&self) {
        self.ctl.cancel();
    }

    /// A handle that cancels this transfer from elsewhere.
    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle {
            ctl: Arc::clone(&self.ctl),
        }
    }
}

impl Future for Transfer {
    type Output = Result<TransferStats>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.fut.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(())) => Poll::Ready(Ok(TransferStats {
                op: self.op,
                bytes: self.bytes,
                descriptors: self.descriptors,
                post_time: self.post_time,
                transfer_time: self.posted.elapsed(),
            })),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // Stops the backend's tasks from writing chunks still queued for this transfer.
        self.ctl.cancel();
    }
}
