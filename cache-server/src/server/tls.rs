//! The server's certificate (configured, or a generated self-signed one) and the TLS
//! configurations built on it: QUIC's, and the TLS-over-TCP listener's (`server.tls`).
//!
//! Client certificates: where a tenant pins one (`tenants.NAME.client_cert_sha256`), both ask
//! clients for a certificate ([`ClientAuth`]). Any certificate is taken at the handshake, whose
//! signature rustls checks against the certificate's key (so the client holds that key); the
//! certificate is then known by the SHA-256 of its DER ([`peer_cert_sha256`]) and the hello
//! looks that up among the pinned ones. Pinning, not a CA: no chain, names or validity
//! dates are checked, as with SSH keys.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

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

/// Whether TLS and QUIC ask clients for a certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAuth {
    /// Not asked (no tenant pins one).
    None,
    /// Asked; a client may go without (and present a token).
    Optional,
    /// A handshake without one fails (`server.tls_client_auth = "required"`).
    Required,
}

/// Takes any client certificate whose handshake signature its key made; which tenant (if
/// any) it names is the hello's business.
#[derive(Debug)]
struct PinnedClients {
    required: bool,
    algs: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for PinnedClients {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.required
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        // Pinned by digest at hello: no chain to build.
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// The rustls server config both listeners share: `versions`, the identity, client
/// certificates as `auth` says.
fn server_config(
    id: &Identity,
    versions: &[&'static rustls::SupportedProtocolVersion],
    auth: ClientAuth,
) -> Result<rustls::ServerConfig, ServerError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algs = provider.signature_verification_algorithms;
    let builder = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| tls(&e))?;
    let builder = match auth {
        ClientAuth::None => builder.with_no_client_auth(),
        ClientAuth::Optional | ClientAuth::Required => {
            builder.with_client_cert_verifier(Arc::new(PinnedClients {
                required: auth == ClientAuth::Required,
                algs,
            }))
        }
    };
    builder
        .with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| tls(&e))
}

/// The SHA-256 of the DER of the client's certificate (the first of its chain), if it
/// presented one.
pub fn peer_cert_sha256(chain: Option<&[CertificateDer<'_>]>) -> Option<[u8; 32]> {
    let der = chain?.first()?;
    let d = ring::digest::digest(&ring::digest::SHA256, der.as_ref());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    Some(out)
}

/// The QUIC server config.
pub fn quic_config(id: &Identity, auth: ClientAuth) -> Result<quinn::ServerConfig, ServerError> {
    let crypto = server_config(id, &[&rustls::version::TLS13], auth)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(crypto).map_err(|e| tls(&e))?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    sc.transport_config(transport());
    Ok(sc)
}

/// The TLS-over-TCP acceptor: TLS 1.2 and 1.3 (ring), client certificates as `auth` says
/// (otherwise clients authenticate with the token inside), ALPN
/// [`kvtier_core::protocol::TLS_ALPN`].
pub fn tcp_acceptor(
    id: &Identity,
    auth: ClientAuth,
) -> Result<tokio_rustls::TlsAcceptor, ServerError> {
    let mut sc = server_config(id, rustls::DEFAULT_VERSIONS, auth)?;
    sc.alpn_protocols = vec![kvtier_core::protocol::TLS_ALPN.to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(sc)))
}
