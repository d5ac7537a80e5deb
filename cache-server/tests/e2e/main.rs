//! End-to-end tests: the real `kvtier-server` binary, driven through the SDK and raw sockets
//! over every transport, on loopback, each with a time bound.

mod arena;
mod brakes;
mod brakes_quic;
mod brakes_shares;
mod common;
mod expiry;
mod fastget;
mod isolation;
mod leaks;
mod lifecycle;
mod limits;
mod long_prefix;
mod malformed;
mod pending;
mod places;
mod retain;
mod sdk;
mod tenants;
mod tls;
