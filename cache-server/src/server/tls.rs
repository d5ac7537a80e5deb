//! QUIC's TLS configuration: a configured certificate, or a generated self-signed one.

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

/// Builds the QUIC server config; returns it, the certificate's DER, and the file the DER
/// was written to when generated.
pub fn server_config(
    c: &ServerConfig,
    runtime: &Path,
) -> Result<(quinn::ServerConfig, Vec<u8>, Option<PathBuf>), ServerError> {
    let tls = |e: &dyn std::fmt::Display| ServerError::Tls(e.to_string());
    let (chain, key, file) = if c.server.tls_cert.is_empty() {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
            .map_err(|e| tls(&e))?;
        let der = ck.cert.der().to_vec();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
        let path = runtime.join("quic-cert.der");
        std::fs::write(&path, &der)
            .map_err(|e| ServerError::Tls(format!("writing {}: {e}", path.display())))?;
        (vec![CertificateDer::from(der)], key, Some(path))
    } else {
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
        (chain, key, None)
    };
    let der = chain[0].to_vec();
    let mut sc = quinn::ServerConfig::with_single_cert(chain, key).map_err(|e| tls(&e))?;
    sc.transport_config(transport());
    Ok((sc, der, file))
}
