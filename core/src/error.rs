use thiserror::Error;

/// Errors of kvtier-core. Every variant names the setting or input that was wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A [`crate::KvLayout`] field is out of range.
    #[error("invalid KV layout: {field} = {value}: {reason}")]
    InvalidLayout {
        field: &'static str,
        value: u64,
        reason: &'static str,
    },
    /// A hash secret is too short or otherwise unusable.
    #[error("invalid hash secret: {reason}")]
    InvalidSecret { reason: &'static str },
    /// A namespace field is too long.
    #[error("invalid namespace field {field}: {reason}")]
    InvalidNamespace {
        field: &'static str,
        reason: &'static str,
    },
    /// A token slice does not hold exactly one block.
    #[error("a block holds {expected} tokens, got {got}")]
    TokenCount { expected: usize, got: usize },
    /// An unknown name for an enumerated setting (dtype, hash scheme, ...).
    #[error("unknown {what} {name:?} (expected one of: {expected})")]
    UnknownName {
        what: &'static str,
        name: String,
        expected: &'static str,
    },
}
