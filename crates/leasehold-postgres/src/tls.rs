//! TLS for `sslmode=prefer|require|verify-ca|verify-full`, with rustls.
//! Its crypto provider is ring, given to each connection rather than installed for the
//! process.
//!
//! As libpq does: `prefer` and `require` encrypt without checking the server's certificate,
//! `verify-ca` checks that a trusted CA signed it, `verify-full` also that it names the host.
//! The trusted CAs are those of `tls_ca`, or the system's.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use leasehold_core::Result;
use leasehold_core::support::{ServerCheck, TlsFiles};
use rustls::pki_types::ServerName;
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
    /// [`Error::InvalidArgument`](leasehold_core::Error::InvalidArgument) for files that
    /// hold no usable certificate or key.
    pub(crate) fn new(mode: SslMode, files: &TlsFiles) -> Result<Self> {
        let check = match mode {
            SslMode::VerifyFull => ServerCheck::Full,
            _ if mode.verifies() => ServerCheck::Chain,
            _ => ServerCheck::None,
        };
        Ok(Self {
            config: Arc::new(files.client_config(check)?),
        })
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
