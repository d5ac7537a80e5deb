//! kvtier-server: the tiered block store and (next) the sidecar daemon around it.

pub mod tier;
