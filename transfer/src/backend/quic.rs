//! QUIC (quinn, TLS 1.3 with ring): one connection per peer carrying `quic_streams`
//! bidirectional streams, each a lane of the stream protocol (`stream.rs`). The target's
//! certificate is self-signed (rcgen) per agent; its DER travels in the metadata blob and the
//! initiator accepts exactly that certificate (pinning). The token HELLO runs on top.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::task::JoinSet;

use super::TargetCtx;
use super::stream::{Lane, StreamPeer, serve};
use crate::error::{Result, TransferError};
use crate::metadata::{AgentMetadata, parse_addr};

const ALPN: &[u8] = b"kvtier-transfer/1";
const SERVER_NAME: &str = "kvtier-transfer";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::BackendUnavailable {
        backend: "quic",
        reason: format!("{what}: {e}"),
    }
}

/// Transport settings shared by the backend and the benchmark's raw-quinn reference: windows
/// large enough that flow control does not cap a loopback stream.
pub fn transport_config() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20))
        .receive_window(quinn::VarInt::from_u32(64 << 20))
        .send_window(64 << 20)
        .max_concurrent_bidi_streams(quinn::VarInt::from_u32(256));
    Arc::new(t)
}

/// A self-signed identity: the server config and the certificate's DER for the blob.
pub fn server_identity() -> Result<(quinn::ServerConfig, Vec<u8>)> {
    let ck = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_owned()])
        .map_err(|e| tls_err("generating a certificate", e))?;
    let cert_der = ck.cert.der().to_vec();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("TLS versions", e))?
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(cert_der.clone())], key)
        .map_err(|e| tls_err("TLS server config", e))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let qs = QuicServerConfig::try_from(tls).map_err(|e| tls_err("QUIC server config", e))?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(qs));
    sc.transport_config(transport_config());
    Ok((sc, cert_der))
}

/// A client config that accepts exactly the certificate `pinned_der`.
pub fn client_config(pinned_der: &[u8]) -> Result<quinn::ClientConfig> {
    let provider = provider();
    let verifier = Arc::new(PinnedCert {
        der: pinned_der.to_vec(),
        provider: Arc::clone(&provider),
    });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("TLS versions", e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let qc = QuicClientConfig::try_from(tls).map_err(|e| tls_err("QUIC client config", e))?;
    let mut cc = quinn::ClientConfig::new(Arc::new(qc));
    cc.transport_config(transport_config());
    Ok(cc)
}

/// Connects a client endpoint bound on `ip` to `addr`, pinning `pinned_der`.
pub async fn connect_raw(
    ip: IpAddr,
    addr: SocketAddr,
    pinned_der: &[u8],
    peer: &str,
) -> Result<(quinn::Endpoint, quinn::Connection)> {
    let endpoint = quinn::Endpoint::client(SocketAddr::new(ip, 0))
        .map_err(|e| TransferError::io("binding a QUIC client endpoint", e))?;
    let connecting = endpoint
        .connect_with(client_config(pinned_der)?, addr, SERVER_NAME)
        .map_err(|e| TransferError::disconnected(peer, format!("QUIC connect: {e}")))?;
    let conn = connecting.await.map_err(|e| match e {
        quinn::ConnectionError::TransportError(t) => TransferError::Auth {
            peer: peer.to_owned(),
            reason: format!("TLS/QUIC handshake: {t}"),
        },
        other => TransferError::disconnected(peer, format!("QUIC handshake: {other}")),
    })?;
    Ok((endpoint, conn))
}

#[derive(Debug)]
struct PinnedCert {
    der: Vec<u8>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.der.as_slice() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the certificate is not the one pinned in the metadata blob".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The target's QUIC endpoint.
pub(crate) fn bind(at: SocketAddr) -> Result<(quinn::Endpoint, SocketAddr, Vec<u8>)> {
    let (sc, cert_der) = server_identity()?;
    let endpoint = quinn::Endpoint::server(sc, at)
        .map_err(|e| TransferError::io(format!("binding a QUIC endpoint on {at}"), e))?;
    let addr = endpoint
        .local_addr()
        .map_err(|e| TransferError::io("QUIC endpoint address", e))?;
    Ok((endpoint, addr, cert_der))
}

/// Accepts connections; each connection's streams are served on their own tasks. Aborting
/// this task drops every connection task (and with them their streams).
pub(crate) async fn accept_loop(ctx: Arc<TargetCtx>, endpoint: quinn::Endpoint) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => { conns.spawn(serve_connection(Arc::clone(&ctx), incoming)); }
                None => return,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve_connection(ctx: Arc<TargetCtx>, incoming: quinn::Incoming) {
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(agent = %ctx.name, "QUIC handshake failed: {e}");
            return;
        }
    };
    let mut streams = JoinSet::new();
    loop {
        tokio::select! {
            bi = conn.accept_bi() => match bi {
                Ok((send, recv)) => { streams.spawn(serve(Arc::clone(&ctx), recv, send)); }
                Err(_) => return,
            },
            Some(_) = streams.join_next(), if !streams.is_empty() => {}
        }
    }
}

pub(crate) async fn connect(
    my_name: &str,
    meta: &AgentMetadata,
    local_ip: IpAddr,
    streams: usize,
    chunk_bytes: u64,
) -> Result<Arc<StreamPeer>> {
    let q = meta
        .quic
        .as_ref()
        .ok_or_else(|| TransferError::BackendUnavailable {
            backend: "quic",
            reason: format!("agent {} does not offer QUIC", meta.name),
        })?;
    let addr = parse_addr("quic", &q.addr)?;
    let (endpoint, conn) = connect_raw(local_ip, addr, &q.cert_der, &meta.name).await?;
    let mut lanes = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (send, recv) = conn.open_bi().await.map_err(|e| {
            TransferError::disconnected(&meta.name, format!("opening a QUIC stream: {e}"))
        })?;
        lanes.push(Lane::start(&meta.name, my_name, &meta.token, recv, send).await?);
    }
    Ok(Arc::new(StreamPeer::new(
        lanes,
        chunk_bytes,
        Some(Box::new((endpoint, conn))),
    )))
}
