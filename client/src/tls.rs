//! The trust both encrypted transports share (QUIC and TLS over TCP): only the certificate
//! the caller gives ([`ClientConfig::server_cert_der`]: the server's own, pinned, or the CA
//! that issued it); there are no system roots. And the TLS-over-TCP connect (`tls://`).

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::ClientConfig;
use crate::error::ClientError;

/// The one certificate this client trusts, as a root store; `what` names the transport in
/// the error when none was given.
pub(crate) fn roots(cfg: &ClientConfig, what: &str) -> Result<rustls::RootCertStore, ClientError> {
    let Some(der) = &cfg.server_cert_der else {
        return Err(ClientError::Connect(format!(
            "{what} needs the server's certificate, or its CA's (ClientConfig::server_cert_der; \
             the server writes a generated one to <runtime_dir>/quic-cert.der): this client \
             trusts no system roots"
        )));
    };
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(der.clone()))
        .map_err(|e| ClientError::Connect(format!("server certificate: {e}")))?;
    Ok(roots)
}

/// The rustls client config of `versions` (ring), trusting [`roots`] only, presenting
/// [`ClientConfig::client_cert_der`] when set.
pub(crate) fn rustls_config(
    cfg: &ClientConfig,
    what: &str,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<rustls::ClientConfig, ClientError> {
    let roots = roots(cfg, what)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| ClientError::Connect(format!("{what}: {e}")))?
        .with_root_certificates(roots);
    let Some((cert, key)) = &cfg.client_cert_der else {
        return Ok(builder.with_no_client_auth());
    };
    let key = PrivateKeyDer::try_from(key.clone()).map_err(|e| {
        ClientError::Connect(format!(
            "client certificate's key (ClientConfig::client_cert_der): {e}"
        ))
    })?;
    builder
        .with_client_auth_cert(vec![CertificateDer::from(cert.clone())], key)
        .map_err(|e| {
            ClientError::Connect(format!(
                "client certificate (ClientConfig::client_cert_der): {e}"
            ))
        })
}

/// The rustls client config of `tls://`: ring, TLS 1.2 and 1.3, ALPN
/// [`kvtier_core::protocol::TLS_ALPN`], trusting [`roots`] only.
fn client_config(cfg: &ClientConfig) -> Result<Arc<rustls::ClientConfig>, ClientError> {
    let mut c = rustls_config(cfg, "tls", rustls::DEFAULT_VERSIONS)?;
    c.alpn_protocols = vec![kvtier_core::protocol::TLS_ALPN.to_vec()];
    Ok(Arc::new(c))
}

/// Connects to `addr` over TCP and completes the TLS handshake, checking the certificate
/// against [`ClientConfig::server_cert_der`] and `server_name`.
pub(crate) async fn connect(
    addr: &str,
    server_name: &str,
    cfg: &ClientConfig,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, ClientError> {
    let config = client_config(cfg)?;
    let name = ServerName::try_from(server_name.to_string()).map_err(|e| {
        ClientError::Connect(format!(
            "server name {server_name:?}: {e} (ClientConfig::server_name)"
        ))
    })?;
    let s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| ClientError::Connect(format!("{addr}: {e}")))?;
    let _ = s.set_nodelay(true);
    tokio_rustls::TlsConnector::from(config)
        .connect(name, s)
        .await
        .map_err(|e| {
            ClientError::Connect(format!(
                "{addr}: TLS handshake: {e} (does ClientConfig::server_cert_der hold the \
                 server's certificate, or its CA's, for the name {server_name:?}?)"
            ))
        })
}
