//! The crate's one error type. Every variant keeps its kind (callers match on it) and carries
//! enough context to say which peer, region or descriptor was at fault.

use std::time::Duration;

/// Everything that can go wrong while registering memory, exchanging metadata or moving bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The peer went away (connection closed or reset, process gone, agent shut down) before
    /// the transfer completed. A transfer that reports this never reports success.
    #[error("peer {peer} disconnected: {detail}")]
    Disconnected { peer: String, detail: String },
    /// The transfer was cancelled (`Transfer::cancel` or the future was dropped) before it
    /// completed. The peer saw no notification for it.
    #[error("transfer {transfer_id} was cancelled")]
    Cancelled { transfer_id: u64 },
    /// An operation with a deadline (connecting, the handshake) ran past it.
    #[error("{operation} with {peer} timed out after {after:?}")]
    TimedOut {
        operation: &'static str,
        peer: String,
        after: Duration,
    },
    /// A descriptor is malformed: zero length, or a range outside its region.
    #[error("invalid descriptor {index}: {reason}")]
    InvalidDescriptor { index: usize, reason: String },
    /// A descriptor names a region that the owning agent does not have registered (never
    /// registered, or deregistered since).
    #[error("region {region} is not registered on agent {agent}")]
    RegionNotFound { agent: String, region: u64 },
    /// The backend is not compiled in, not enabled on one side, or cannot reach this memory.
    #[error("backend {backend} unavailable: {reason}")]
    BackendUnavailable {
        backend: &'static str,
        reason: String,
    },
    /// A metadata blob was malformed, truncated, oversized or of another version.
    #[error("malformed metadata blob: {reason}")]
    Metadata { reason: String },
    /// The peer sent a frame that breaks the wire protocol.
    #[error("protocol error from {peer}: {reason}")]
    Protocol { peer: String, reason: String },
    /// The peer refused our credentials (token or TLS identity).
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    /// The configuration cannot work (zero streams, a chunk size of zero, ...).
    #[error("invalid configuration: {reason}")]
    Config { reason: String },
    /// An operating-system call failed outside a peer connection (memfd, mmap, bind, ...).
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// The kind of a [`TransferError`], for callers that branch on it (retry on `Disconnected`,
/// recompute on `RegionNotFound`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    Disconnected,
    Cancelled,
    TimedOut,
    InvalidDescriptor,
    RegionNotFound,
    BackendUnavailable,
    Metadata,
    Protocol,
    Auth,
    Config,
    Io,
}

impl TransferError {
    /// This error's kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Disconnected { .. } => ErrorKind::Disconnected,
            Self::Cancelled { .. } => ErrorKind::Cancelled,
            Self::TimedOut { .. } => ErrorKind::TimedOut,
            Self::InvalidDescriptor { .. } => ErrorKind::InvalidDescriptor,
            Self::RegionNotFound { .. } => ErrorKind::RegionNotFound,
            Self::BackendUnavailable { .. } => ErrorKind::BackendUnavailable,
            Self::Metadata { .. } => ErrorKind::Metadata,
            Self::Protocol { .. } => ErrorKind::Protocol,
            Self::Auth { .. } => ErrorKind::Auth,
            Self::Config { .. } => ErrorKind::Config,
            Self::Io { .. } => ErrorKind::Io,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn disconnected(peer: &str, detail: impl Into<String>) -> Self {
        Self::Disconnected {
            peer: peer.to_owned(),
            detail: detail.into(),
        }
    }

    pub(crate) fn protocol(peer: &str, reason: impl Into<String>) -> Self {
        Self::Protocol {
            peer: peer.to_owned(),
            reason: reason.into(),
        }
    }

    /// A copy of this error for a second waiter (errors are reported to every chunk of a
    /// failed transfer). `Io` sources are re-created from their kind and message.
    pub(crate) fn duplicate(&self) -> Self {
        match self {
            Self::Disconnected { peer, detail } => Self::Disconnected {
                peer: peer.clone(),
                detail: detail.clone(),
            },
            Self::Cancelled { transfer_id } => Self::Cancelled {
                transfer_id: *transfer_id,
            },
            Self::TimedOut {
                operation,
                peer,
                after,
            } => Self::TimedOut {
                operation,
                peer: peer.clone(),
                after: *after,
            },
            Self::InvalidDescriptor { index, reason } => Self::InvalidDescriptor {
                index: *index,
                reason: reason.clone(),
            },
            Self::RegionNotFound { agent, region } => Self::RegionNotFound {
                agent: agent.clone(),
                region: *region,
            },
            Self::BackendUnavailable { backend, reason } => Self::BackendUnavailable {
                backend,
                reason: reason.clone(),
            },
            Self::Metadata { reason } => Self::Metadata {
                reason: reason.clone(),
            },
            Self::Protocol { peer, reason } => Self::Protocol {
                peer: peer.clone(),
                reason: reason.clone(),
            },
            Self::Auth { peer, reason } => Self::Auth {
                peer: peer.clone(),
                reason: reason.clone(),
            },
            Self::Config { reason } => Self::Config {
                reason: reason.clone(),
            },
            Self::Io { context, source } => Self::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }
}

/// The crate's result type.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;
