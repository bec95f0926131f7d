//! TLS material from URL parameters, shared by the backends that speak TLS.

use crate::{Error, Result};

/// What a TLS connection trusts and shows beyond the defaults, as PEM contents.
/// It holds CA certificates to trust instead of the system's, and a client certificate
/// with its key for servers that ask for one. Its `Debug` never shows the contents.
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

    /// Reads the file of a `tls_ca`, `tls_cert` or `tls_key` URL parameter now.
    /// Returns `false` if `param` is none of them.
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

    /// Checks the files against the connection.
    /// There may be none without TLS (`tls_scheme` names the URL scheme that has it), and a
    /// client certificate only with its key.
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
}
