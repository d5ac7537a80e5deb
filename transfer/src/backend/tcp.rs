//! TCP: `tcp_streams` connections per peer, each a lane of the stream protocol
//! (`stream.rs`); a transfer's chunks are striped over the lanes round-robin.
//! Authentication: the HELLO frame carries the target's token from its metadata blob.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::TargetCtx;
use super::stream::{Lane, StreamPeer, serve};
use crate::error::{Result, TransferError};
use crate::metadata::{AgentMetadata, parse_addr};

/// Accepts connections and serves each on its own task; aborting this task (agent shutdown)
/// drops the set and so every connection.
pub(crate) async fn accept_loop(ctx: Arc<TargetCtx>, listener: TcpListener) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => {
                    let _ = sock.set_nodelay(true);
                    let (r, w) = sock.into_split();
                    conns.spawn(serve(Arc::clone(&ctx), r, w));
                }
                Err(e) => {
                    tracing::warn!(agent = %ctx.name, "tcp accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

pub(crate) async fn bind(at: SocketAddr) -> Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(at)
        .await
        .map_err(|e| TransferError::io(format!("binding a TCP listener on {at}"), e))?;
    let addr = l
        .local_addr()
        .map_err(|e| TransferError::io("TCP listener address", e))?;
    Ok((l, addr))
}

pub(crate) async fn connect(
    my_name: &str,
    meta: &AgentMetadata,
    streams: usize,
    chunk_bytes: u64,
) -> Result<Arc<StreamPeer>> {
    let addr = meta
        .tcp
        .as_deref()
        .ok_or_else(|| TransferError::BackendUnavailable {
            backend: "tcp",
            reason: format!("agent {} does not offer TCP", meta.name),
        })?;
    let addr = parse_addr("tcp", addr)?;
    let mut lanes = Vec::with_capacity(streams);
    for _ in 0..streams {
        let sock = TcpStream::connect(addr).await.map_err(|e| {
            TransferError::disconnected(&meta.name, format!("connect to {addr}: {e}"))
        })?;
        sock.set_nodelay(true)
            .map_err(|e| TransferError::io("TCP_NODELAY", e))?;
        let (r, w) = sock.into_split();
        lanes.push(Lane::start(&meta.name, my_name, &meta.token, r, w).await?);
    }
    Ok(Arc::new(StreamPeer::new(lanes, chunk_bytes, None)))
}
