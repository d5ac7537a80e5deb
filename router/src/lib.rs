//! kvtier-router: an OpenAI-compatible front that sends each request to the inference worker
//! expected to answer it first, knowing from each worker's kvtier server's block events which
//! prefixes it can load. See `docs/router.md`.
//!
//! * [`index`]: the blocks of each kvtier server, from its events (sans-IO).
//! * [`events`]: the subscriber task per server (snapshot, stream, resync).
//! * [`prompt`]: a request rendered, tokenized and hashed exactly as the workers do.
//! * [`recent`]: blocks the router sent each worker, until its server's events show them.
//! * [`load`]: each worker's prefill rate, decode step and load bandwidth per tier, measured
//!   from its answers.
//! * [`usage`]: what the router reads from the end of an answer (cached tokens, load report).
//! * [`sessions`]: each session's home worker, for session affinity.
//! * [`score`]: expected time to first token per worker, and the ranking (sans-IO).
//! * [`mismatch`]: predicted against reported cached tokens (sans-IO).
//! * [`server`]: the HTTP front, forwarding, retries, health checks.
//! * `members` (feature `cluster`): workers from a kvtier cluster's membership on etcd.

pub mod config;
mod error;
pub mod events;
pub mod index;
pub mod load;
#[cfg(feature = "cluster")]
pub mod members;
pub mod metrics;
pub mod mismatch;
pub mod prompt;
pub mod recent;
pub mod score;
pub mod server;
pub mod sessions;
pub mod usage;

pub use config::{RouterConfig, WorkerConfig};
pub use error::RouterError;
pub use server::Router;
