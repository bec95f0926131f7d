//! TLS for `sslmode=prefer|require|verify-ca|verify-full`, with rustls (ring as the crypto
//! provider, given to each connection rather than installed for the process).
//!
//! As libpq does: `prefer` and `require` encrypt without checking the server's certificate,
//! `verify-ca` checks that a trusted CA signed it, `verify-full` also that it names the host.
//! The trusted CAs are those of `tls_ca`, or the system's.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use leasehold_core::support::TlsFiles;
use leasehold_core::{Error, Result};
use rustls::DigitallySignedStruct;
use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::Socket;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

use crate::options::SslMode;

/// Makes the TLS session of each connection (never used with `sslmode=disable`).
#[derive(Clone)]
pub(crate) struct Tls {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

impl Tls {
    /// The TLS set-up for `mode` with `files`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for files that hold no usable certificate or key.
    pub(crate) fn new(mode: SslMode, files: &TlsFiles) -> Result<Self> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid("tls", e.to_string()))?;
        let verifier: Arc<dyn ServerCertVerifier> = if mode.verifies() {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(files)?),
                provider.clone(),
            )
            .build()
            .map_err(|e| Error::invalid("tls_ca", e.to_string()))?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(AnyName(webpki))
            }
        } else {
            Arc::new(Unchecked(provider))
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let config = match &files.client {
            None => builder.with_no_client_auth(),
            Some((certificate, key)) => {
                let chain = CertificateDer::pem_slice_iter(certificate)
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| Error::invalid("tls_cert", format!("{e:?}")))?;
                if chain.is_empty() {
                    return Err(Error::invalid("tls_cert", "no PEM certificate in it"));
                }
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| Error::invalid("tls_key", format!("{e:?}")))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| Error::invalid("tls_cert", e.to_string()))?
            }
        };
        Ok(Self {
            config: Arc::new(config),
        })
    }
}

/// The CAs of `files`, or the system's.
fn roots(files: &TlsFiles) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    match &files.ca {
        Some(pem) => {
            for certificate in CertificateDer::pem_slice_iter(pem) {
                let certificate =
                    certificate.map_err(|e| Error::invalid("tls_ca", format!("{e:?}")))?;
                roots
                    .add(certificate)
                    .map_err(|e| Error::invalid("tls_ca", e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(Error::invalid("tls_ca", "no PEM certificate in it"));
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    Ok(roots)
}

/// `verify-ca`: the chain is checked, the name is not.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require`: encrypted, the certificate not checked (the handshake's own
/// signatures still are).
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
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
            &self.0.signature_verification_algorithms,
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
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl MakeTlsConnect<Socket> for Tls {
    type Stream = TlsStream;
    type TlsConnect = Handshake;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> io::Result<Handshake> {
        let name = ServerName::try_from(domain.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(Handshake {
            connector: tokio_rustls::TlsConnector::from(self.config.clone()),
            name,
        })
    }
}

/// One connection's TLS handshake.
pub(crate) struct Handshake {
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for Handshake {
    type Stream = TlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let stream = self.connector.connect(self.name, stream).await?;
            Ok(TlsStream(Box::new(stream)))
        })
    }
}

/// A TLS connection to the server.
pub(crate) struct TlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl tokio_postgres::tls::TlsStream for TlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().0).poll_shutdown(cx)
    }
}
