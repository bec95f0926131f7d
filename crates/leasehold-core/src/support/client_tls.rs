//! The rustls client configuration, built from [`TlsFiles`]: the `tls` feature.
//! It serves the backends that speak TLS with rustls themselves (etcd, PostgreSQL).

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};

use super::TlsFiles;
use crate::{Error, Result};

/// How a TLS client checks the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerCheck {
    /// Signed by a trusted CA, for the host connected to.
    Full,
    /// Signed by a trusted CA, whatever host it names.
    Chain,
    /// Not checked; the connection is still encrypted.
    /// The handshake's own signatures are still verified.
    None,
}

impl TlsFiles {
    /// A rustls client configuration that checks the server's certificate as `check` says.
    /// The check is against the CAs of `tls_ca` (or the system's); the client certificate
    /// is shown if there is one. Its crypto provider (ring) is given to it, not installed
    /// for the process.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the parameter whose file holds no usable
    /// certificate or key.
    pub fn client_config(&self, check: ServerCheck) -> Result<ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid("tls", e.to_string()))?;
        let chain = match check {
            ServerCheck::None => None,
            ServerCheck::Chain | ServerCheck::Full => Some(
                WebPkiServerVerifier::builder_with_provider(
                    Arc::new(self.roots()?),
                    provider.clone(),
                )
                .build()
                .map_err(|e| Error::invalid("tls_ca", e.to_string()))?,
            ),
        };
        let verifier: Arc<dyn ServerCertVerifier> = match (check, chain) {
            (ServerCheck::Full, Some(webpki)) => webpki,
            (_, chain) => Arc::new(Lenient { chain, provider }),
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let Some((certificate, key)) = &self.client else {
            return Ok(builder.with_no_client_auth());
        };
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
            .map_err(|e| Error::invalid("tls_cert", e.to_string()))
    }

    /// The CAs of `tls_ca`, or the system's.
    fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        let Some(pem) = &self.ca else {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            return Ok(roots);
        };
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
        Ok(roots)
    }
}

/// A check short of [`ServerCheck::Full`].
/// It checks the chain without the name (`chain`), or nothing but the handshake's
/// signatures.
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

type Verified<T> = std::result::Result<T, rustls::Error>;
type Signed = Verified<HandshakeSignatureValid>;
type Dss = DigitallySignedStruct;

impl Lenient {
    fn algorithms(&self) -> &WebPkiSupportedAlgorithms {
        &self.provider.signature_verification_algorithms
    }
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Verified<ServerCertVerified> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        rustls::crypto::verify_tls12_signature(m, c, d, self.algorithms())
    }

    fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &Dss) -> Signed {
        rustls::crypto::verify_tls13_signature(m, c, d, self.algorithms())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms().supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_configuration_names_the_file_that_holds_nothing_usable() {
        let what = |files: &TlsFiles, check| match files.client_config(check) {
            Err(Error::InvalidArgument { what, .. }) => what,
            other => panic!("{:?}", other.map(|_| "a configuration")),
        };
        // (The system's CAs, which a check without `tls_ca` reads, are the system's affair.)
        assert!(TlsFiles::default().client_config(ServerCheck::None).is_ok());
        let files = TlsFiles {
            ca: Some(b"not a certificate".to_vec()),
            ..TlsFiles::default()
        };
        assert_eq!(what(&files, ServerCheck::Full), "tls_ca");
        assert_eq!(what(&files, ServerCheck::Chain), "tls_ca");
        // Without a check the CAs are not read.
        assert!(files.client_config(ServerCheck::None).is_ok());
        let files = TlsFiles {
            client: Some((b"no certificate".to_vec(), b"no key".to_vec())),
            ..TlsFiles::default()
        };
        assert_eq!(what(&files, ServerCheck::None), "tls_cert");
    }
}
