//! kvtier-testkit: what the workspace's tests share, kept out of the libraries. Every crate
//! takes it as a dev-dependency only; it is never published.
//!
//! * [`process`]: a binary run as a child process with a time bound, killed if it overruns or
//!   if the test panics while it runs.
//! * [`prompt`]: seeded prompts and a comparison of logits for the worker's model tests.
//! * [`block`]: block payloads that verify themselves (a function of key and length).
//! * [`tier`]: the conformance suite every kvtier-server `Tier` passes.
//! * [`promtool`]: `promtool check metrics` over a `/metrics` text (a missing promtool fails).
//! * [`etcd`]: a real etcd on loopback (or an address of the test's network namespace).

pub mod block;
pub mod etcd;
pub mod process;
pub mod prompt;
pub mod promtool;
pub mod tier;
