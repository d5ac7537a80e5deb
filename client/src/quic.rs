//! QUIC transport: one bidirectional stream per client connection, TLS with the server's
//! certificate pinned (from the server's runtime directory, or configured): the trust of
//! [`crate::tls::roots`], which `tls://` shares.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::ClientConfig;
use crate::error::ClientError;

pub(crate) async fn connect(
    addr: &str,
    server_name: &str,
    cfg: &ClientConfig,
) -> Result<(quinn::SendStream, quinn::RecvStream), ClientError> {
    let crypto = crate::tls::rustls_config(cfg, "quic", &[&rustls::version::TLS13])?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
        .map_err(|e| ClientError::Connect(format!("quic: {e}")))?;
    let mut qc = quinn::ClientConfig::new(Arc::new(crypto));
    qc.transport_config(transport());
    let remote: SocketAddr = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| ClientError::Connect(format!("{addr}: {e}")))?
        .next()
        .ok_or_else(|| ClientError::Connect(format!("{addr}: no address")))?;
    let local: SocketAddr = if remote.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .map_err(|_| ClientError::Connect("local address".into()))?;
    let mut ep = quinn::Endpoint::client(local).map_err(ClientError::Io)?;
    ep.set_default_client_config(qc);
    let conn = ep
        .connect(remote, server_name)
        .map_err(|e| ClientError::Connect(format!("{addr}: {e}")))?
        .await
        .map_err(|e| ClientError::Connect(format!("{addr}: {e}")))?;
    conn.open_bi()
        .await
        .map_err(|e| ClientError::Connect(format!("{addr}: {e}")))
}

/// The QUIC transport settings kvtier clients use: the protocol's flow-control windows
/// ([`kvtier_core::protocol::QUIC_WINDOW_BYTES`]) and a keep-alive.
pub fn transport() -> Arc<quinn::TransportConfig> {
    let w = kvtier_core::protocol::QUIC_WINDOW_BYTES;
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(w));
    t.receive_window(quinn::VarInt::from_u32(w));
    t.send_window(u64::from(w));
    t.keep_alive_interval(Some(std::time::Duration::from_secs(5)));
    Arc::new(t)
}
