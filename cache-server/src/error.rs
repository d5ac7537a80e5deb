use thiserror::Error;

use crate::tier::TierError;

/// Errors of the store's API. A miss is not an error ([`crate::store::GetOutcome::Miss`]).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("invalid configuration: {setting}: {reason}")]
    Config {
        setting: &'static str,
        reason: String,
    },
    #[error("{what} is {got} bytes but the layout's blocks are {expected} bytes")]
    WrongSize {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error("cannot start the store's threads: {0}")]
    Threads(std::io::Error),
}
