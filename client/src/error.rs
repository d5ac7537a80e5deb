use kvtier_core::protocol::{ErrorCode, ErrorReply, FrameError};

/// Why a call failed. Cache calls ([`crate::Client::lookup`], `get_into`, `put`) never return
/// it: they report a [`crate::Miss`] instead, so an inference worker recomputes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error(
        "bad server address {0:?} (expected unix:///path, tcp://host:port, tls://host:port or \
         quic://host:port)"
    )]
    BadUrl(String),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("server refused: {code:?}: {message}")]
    Server {
        code: Option<ErrorCode>,
        message: String,
    },
    #[error("timed out")]
    Timeout,
    #[error("connection lost")]
    Disconnected,
    #[error("i/o: {0}")]
    Io(std::io::Error),
    #[error("bad frame from server: {0}")]
    Frame(FrameError),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("wrong buffer: {0}")]
    Buffer(String),
    #[error("bad HTTP request: {0}")]
    HttpUrl(String),
    #[error("HTTP: {0}")]
    Http(String),
    #[error("HTTP body over {limit} bytes")]
    TooLarge { limit: usize },
    #[error("{0} needs the local zero-copy path (unix:// with zero_copy)")]
    NotLocal(&'static str),
}

impl ClientError {
    pub(crate) fn from_reply(e: ErrorReply) -> Self {
        ClientError::Server {
            code: ErrorCode::from_u16(e.code),
            message: e.message,
        }
    }
}
