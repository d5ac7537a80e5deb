//! kvtier-transfer: registered memory and one-sided block transfers between processes and
//! machines, over shared memory, TCP, QUIC, UCX (feature `ucx`) and CUDA (feature `cuda`).
//!
//! An [`Agent`] registers memory regions and exports a metadata blob; a peer agent loads the
//! blob with [`Agent::connect`] and posts one-sided READ/WRITE transfers of [`Descriptor`]
//! lists on the resulting [`Peer`]. The target side does no application work: its agent's
//! tasks serve the requests. See `docs/transfer.md` for the API tour, the thread-safety
//! contract, the wire format and what each backend has been verified on.
//!
//! ```no_run
//! # async fn demo() -> kvtier_transfer::Result<()> {
//! use kvtier_transfer::{Agent, AgentConfig, BackendKind, Descriptor};
//! let decode = Agent::new("decode", AgentConfig::default()).await?;
//! let prefill = Agent::new("prefill", AgentConfig::default()).await?;
//! let dst = decode.alloc_dram(2 << 20)?;
//! let src = prefill.alloc_dram(2 << 20)?;
//! let peer = prefill.connect(&decode.metadata()?, BackendKind::Tcp).await?;
//! let d = Descriptor::new(src.id(), 0, dst.id(), 0, 2 << 20);
//! let stats = peer.post(kvtier_transfer::Op::Write, &[d], Some(b"block 7".to_vec()))?.await?;
//! println!("{} bytes in {:?}", stats.bytes, stats.transfer_time);
//! # Ok(()) }
//! ```

mod agent;
pub mod backend;
mod descriptor;
mod error;
pub mod metadata;
mod region;
mod transfer;

pub use agent::{Agent, AgentConfig, Peer};
pub use backend::BackendKind;
pub use backend::Notification;
pub use backend::frame::MAX_NOTIFICATION_BYTES;
pub use descriptor::{Descriptor, Op, merge_adjacent};
pub use error::{ErrorKind, Result, TransferError};
pub use metadata::TOKEN_BYTES;
pub use region::{MemKind, RegionHandle, RegionId};
pub use transfer::{CancelHandle, SettleHandle, Transfer, TransferStats};

#[cfg(feature = "cuda")]
pub use region::cuda::probe as cuda_probe;
