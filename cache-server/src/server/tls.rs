//! The server's certificate (configured, or a generated self-signed one) and the TLS
//! configurations built on it: QUIC's, and the TLS-over-TCP listener's (`server.tls`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::{ServerConfig, ServerError};

/// Flow-control windows: [`kvtier_core::protocol::QUIC_WINDOW_BYTES`] (they bound the
/// server's memory per QUIC connection, counted against the 5 % RSS budget).
pub fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    let w = kvtier_core::protocol::QUIC_WINDOW_BYTES;
    t.stream_receive_window(quinn::VarInt::from_u32(w));
    t.receive_window(quinn::VarInt::from_u32(w));
    t.send_window(u64::from(w));
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(16));
    t.keep_alive_interval(Some(std::time::Duration::from_secs(5)));
    Arc::new(t)
}

/// The certificate chain and key QUIC and TLS present (one for both).
pub struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// Where the certificate was written, when generated.
    pub file: Option<PathBuf>,
}

impl Identity {
    /// The leaf certificate's DER (what clients pin).
    pub fn cert_der(&self) -> Vec<u8> {
        self.chain[0].to_vec()
    }
}

fn tls(e: &dyn std::fmt::Display) -> ServerError {
    ServerError::Tls(e.to_string())
}

/// `server.tls_cert` and `server.tls_key`, or a self-signed certificate for `localhost`
/// generated now and written to `<runtime>/quic-cert.der` for clients to pin.
pub fn identity(c: &ServerConfig, runtime: &Path) -> Result<Identity, ServerError> {
    if c.server.tls_cert.is_empty() {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
            .map_err(|e| tls(&e))?;
        let der = ck.cert.der().to_vec();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
        let path = runtime.join("quic-cert.der");
        std::fs::write(&path, &der)
            .map_err(|e| ServerError::Tls(format!("writing {}: {e}", path.display())))?;
        return Ok(Identity {
            chain: vec![CertificateDer::from(der)],
            key,
            file: Some(path),
        });
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&c.server.tls_cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| ServerError::Tls(format!("server.tls_cert {}: {e}", c.server.tls_cert)))?;
    if chain.is_empty() {
        return Err(ServerError::Tls(format!(
            "server.tls_cert {}: no certificate in the file",
            c.server.tls_cert
        )));
    }
    let key = PrivateKeyDer::from_pem_file(&c.server.tls_key)
        .map_err(|e| ServerError::Tls(format!("server.tls_key {}: {e}", c.server.tls_key)))?;
    Ok(Identity {
        chain,
        key,
        file: None,
    })
}

/// The QUIC server config.
pub fn quic_config(id: &Identity) -> Result<quinn::ServerConfig, ServerError> {
    let mut sc = quinn::ServerConfig::with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| tls(&e))?;
    sc.transport_config(transport());
    Ok(sc)
}

/// The TLS-over-TCP acceptor: TLS 1.2 and 1.3 (ring), no client certificates (clients
/// authenticate with the token inside), ALPN [`kvtier_core::protocol::TLS_ALPN`].
pub fn tcp_acceptor(id: &Identity) -> Result<tokio_rustls::TlsAcceptor, ServerError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut sc = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls(&e))?
        .with_no_client_auth()
        .with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| tls(&e))?;
    sc.alpn_protocols = vec![kvtier_core::protocol::TLS_ALPN.to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(sc)))
}
