//! TLS material from URL parameters, shared by the backends that speak TLS; with the `tls`
//! feature, the rustls client configuration built from it.

use crate::{Error, Result};

/// What a TLS connection trusts and shows beyond the defaults, as PEM contents: CA
/// certificates to trust instead of the system's, and a client certificate with its key
/// for servers that ask for one. Its `Debug` never shows the contents.
#[derive(Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsFiles {
    /// CA certificates to trust instead of the system's.
    pub ca: Option<Vec<u8>>,
    /// A client certificate and its key.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("ca", &self.ca.is_some())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

impl TlsFiles {
    /// The URL parameters this reads: `tls_ca`, `tls_cert`, `tls_key` (each a file path).
    pub const PARAMS: &'static str = "tls_ca, tls_cert, tls_key";

    /// Whether nothing beyond the defaults is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Reads the file of a `tls_ca`, `tls_cert` or `tls_key` URL parameter now; `false`
    /// if `param` is none of them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the file if it cannot be read.
    pub fn read_param(&mut self, param: &str, path: &str) -> Result<bool> {
        let read = || {
            std::fs::read(path)
                .map_err(|e| Error::invalid("url", format!("{param}={path:?} cannot be read: {e}")))
        };
        match param {
            "tls_ca" => self.ca = Some(read()?),
            "tls_cert" => {
                let key = self.client.take().map(|(_, key)| key).unwrap_or_default();
                self.client = Some((read()?, key));
            }
            "tls_key" => {
                let cert = self.client.take().map(|(cert, _)| cert).unwrap_or_default();
                self.client = Some((cert, read()?));
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks the files against the connection: none without TLS (`tls_scheme` names the
    /// URL scheme that has it), and a client certificate only with its key.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] otherwise.
    pub fn check(&self, tls: bool, tls_scheme: &str) -> Result<()> {
        if !tls && !self.is_empty() {
            return Err(Error::invalid(
                "url",
                format!("{} need a {tls_scheme}:// URL", Self::PARAMS),
            ));
        }
        if let Some((cert, key)) = &self.client
            && (cert.is_empty() || key.is_empty())
        {
            return Err(Error::invalid(
                "url",
                "a client certificate needs both tls_cert and tls_key",
            ));
        }
        Ok(())
    }
}

/// How a TLS client checks the server's certificate (with the `tls` feature).
#[cfg(feature = "tls")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerCheck {
    /// Signed by a trusted CA, for the host connected to.
    Full,
    /// Signed by a trusted CA, whatever host it names.
    Chain,
    /// Not checked: the connection is encrypted, and the handshake's own signatures are
    /// still verified.
    None,
}

#[cfg(feature = "tls")]
impl TlsFiles {
    /// A rustls client configuration: the server's certificate checked as `check` says,
    /// against the CAs of `tls_ca` (or the system's); the client certificate if there is
    /// one. Its crypto provider (ring) is given to it, not installed for the process.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the parameter whose file holds no usable
    /// certificate or key.
    pub fn client_config(&self, check: ServerCheck) -> Result<rustls::ClientConfig> {
        use std::sync::Arc;

        use rustls::client::WebPkiServerVerifier;
        use rustls::client::danger::ServerCertVerifier;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        use self::lenient::Lenient;

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid("tls", e.to_string()))?;
        let verifier: Arc<dyn ServerCertVerifier> = match check {
            ServerCheck::None => Arc::new(Lenient {
                chain: None,
                provider,
            }),
            ServerCheck::Chain | ServerCheck::Full => {
                let webpki = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(self.roots()?),
                    provider.clone(),
                )
                .build()
                .map_err(|e| Error::invalid("tls_ca", e.to_string()))?;
                match check {
                    ServerCheck::Full => webpki,
                    _ => Arc::new(Lenient {
                        chain: Some(webpki),
                        provider,
                    }),
                }
            }
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
    fn roots(&self) -> Result<rustls::RootCertStore> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;

        let mut roots = rustls::RootCertStore::empty();
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

#[cfg(feature = "tls")]
mod lenient {
    use std::sync::Arc;

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::CryptoProvider;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, DigitallySignedStruct, Error, SignatureScheme};

    /// A check short of [`ServerCheck::Full`](super::ServerCheck::Full): the chain without
    /// the name (`chain`), or nothing but the handshake's signatures.
    #[derive(Debug)]
    pub(super) struct Lenient {
        pub(super) chain: Option<Arc<WebPkiServerVerifier>>,
        pub(super) provider: Arc<CryptoProvider>,
    }

    impl ServerCertVerifier for Lenient {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp_response: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, Error> {
            let Some(chain) = &self.chain else {
                return Ok(ServerCertVerified::assertion());
            };
            match chain.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            ) {
                Err(Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            let algorithms = &self.provider.signature_verification_algorithms;
            rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            let algorithms = &self.provider.signature_verification_algorithms;
            rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider
                .signature_verification_algorithms
                .supported_schemes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_read_checked_and_never_shown() {
        let mut files = TlsFiles::default();
        let err = files.read_param("tls_ca", "/no/such/ca.pem").unwrap_err();
        assert!(err.to_string().contains("/no/such/ca.pem"), "{err}");
        assert!(!files.read_param("prefix", "x").unwrap());
        let dir = std::env::temp_dir().join(format!("leasehold-core-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let (ca, cert, key) = (file("ca", "CA"), file("cert", "CERT"), file("key", "KEY"));
        assert!(files.read_param("tls_cert", &cert).unwrap());
        assert!(
            files.check(true, "x").is_err(),
            "a certificate without its key"
        );
        assert!(files.read_param("tls_key", &key).unwrap());
        assert!(files.read_param("tls_ca", &ca).unwrap());
        assert_eq!(files.ca.as_deref(), Some(&b"CA"[..]));
        assert_eq!(files.client, Some((b"CERT".to_vec(), b"KEY".to_vec())));
        assert!(!format!("{files:?}").contains("KEY"));
        assert!(files.check(true, "x").is_ok());
        let err = files.check(false, "rediss").unwrap_err();
        assert!(err.to_string().contains("rediss://"), "{err}");
        assert!(TlsFiles::default().check(false, "rediss").is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(feature = "tls")]
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
