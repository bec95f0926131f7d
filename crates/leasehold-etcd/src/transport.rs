//! The connection to etcd: one HTTP/2 connection at a time, to one member.
//! It moves on to the next member each time it has to connect again (the member it used
//! went away or stopped answering its keep-alive pings). Over TLS (`https://` endpoints)
//! each member's certificate is checked against that member's own host name.
//!
//! The stream is offered to HTTP/2 without vectored writes. With vectored writes, h2
//! sends any message over 256 bytes (a queueing transaction is a few hundred) with a
//! write of its own and the end of the stream with another; etcd then wakes twice for one
//! request. Without them, h2 copies messages of up to 1 KiB into its buffer and every
//! unary request leaves in one write.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use leasehold_core::support::{ServerCheck, TlsFiles};
use leasehold_core::{Error, Result};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// HTTP/2 keep-alive pings on a connection with open streams.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeepAlive {
    /// How often.
    pub(crate) every: Duration,
    /// How long one may go unanswered before the connection is dropped.
    pub(crate) timeout: Duration,
}

/// A lazily connected channel to the members at `endpoints`.
/// They are all `http://host:port`, or all `https://host:port` for TLS with `tls`; HTTP/2
/// keep-alive pings go as `keep_alive` says (the connection is dropped when one goes
/// unanswered) so that a paused member is left for the next one.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a malformed or mixed list of endpoints, TLS files on
/// plain endpoints, or TLS files that hold no usable certificate or key.
pub(crate) fn channel(
    endpoints: &[String],
    tls: &TlsFiles,
    connect_timeout: Duration,
    keep_alive: KeepAlive,
) -> Result<Channel> {
    let invalid = |reason: String| Error::invalid("endpoints", reason);
    let first = endpoints
        .first()
        .ok_or_else(|| invalid("no endpoints".into()))?;
    let secure = endpoints.iter().all(|e| e.starts_with("https://"));
    let scheme = if secure { "https://" } else { "http://" };
    let members = endpoints
        .iter()
        .map(|endpoint| {
            let address = endpoint.strip_prefix(scheme).ok_or_else(|| {
                invalid(format!(
                    "{endpoint}: every endpoint is http://host:port, or every one https://host:port"
                ))
            })?;
            Member::new(address, secure).map_err(|e| invalid(format!("{endpoint}: {e}")))
        })
        .collect::<Result<Arc<[Member]>>>()?;
    tls.check(secure, "https")?;
    let count = u32::try_from(members.len().max(1)).unwrap_or(u32::MAX);
    let connector = Members {
        members,
        tls: secure.then(|| tls_connector(tls)).transpose()?,
        next: Arc::default(),
        // Every member gets its share of the connect timeout, which bounds the whole attempt.
        each: connect_timeout / count,
    };
    let endpoint = Endpoint::from_shared(first.clone())
        .map_err(|e| invalid(format!("{first}: {e}")))?
        .connect_timeout(connect_timeout)
        .http2_keep_alive_interval(keep_alive.every)
        .keep_alive_timeout(keep_alive.timeout)
        .keep_alive_while_idle(false);
    Ok(endpoint.connect_with_connector_lazy(connector))
}

/// TLS for every member.
/// The CA certificates of `files` (or the system's), its client certificate if any, HTTP/2
/// by ALPN (which etcd's TLS port needs for gRPC).
fn tls_connector(files: &TlsFiles) -> Result<TlsConnector> {
    let mut config = files.client_config(ServerCheck::Full)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// One member: where to connect, and the name its certificate must carry.
struct Member {
    address: String,
    name: Option<ServerName<'static>>,
}

impl Member {
    fn new(address: &str, secure: bool) -> std::result::Result<Self, String> {
        let host = match address.rsplit_once(':') {
            Some((host, port)) if port.parse::<u16>().is_ok() => host,
            _ => return Err("expected host:port".into()),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = secure
            .then(|| ServerName::try_from(host.to_owned()).map_err(|e| e.to_string()))
            .transpose()?;
        Ok(Self {
            address: address.to_owned(),
            name,
        })
    }

    async fn connect(&self, tls: Option<&TlsConnector>) -> io::Result<Stream> {
        let tcp = TcpStream::connect(self.address.as_str()).await?;
        tcp.set_nodelay(true)?;
        let Some(tls) = tls else {
            return Ok(Stream::Plain(tcp));
        };
        // Never plain text where TLS was asked for.
        let name = self
            .name
            .clone()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no server name for TLS"))?;
        Ok(Stream::Tls(Box::new(tls.connect(name, tcp).await?)))
    }
}

/// Connects to the members in turn, starting after the one connected to last.
#[derive(Clone)]
struct Members {
    members: Arc<[Member]>,
    tls: Option<TlsConnector>,
    next: Arc<AtomicUsize>,
    each: Duration,
}

impl tower_service::Service<Uri> for Members {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let count = this.members.len();
            let first = this.next.fetch_add(1, Ordering::Relaxed);
            let mut failure = io::Error::new(io::ErrorKind::NotFound, "no etcd endpoints");
            for turn in 0..count {
                let member = &this.members[(first + turn) % count];
                match tokio::time::timeout(this.each, member.connect(this.tls.as_ref())).await {
                    Ok(Ok(stream)) => return Ok(TokioIo::new(stream)),
                    Ok(Err(error)) => {
                        failure =
                            io::Error::new(error.kind(), format!("{}: {error}", member.address));
                    }
                    Err(_) => {
                        failure = io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("connecting to {} timed out", member.address),
                        );
                    }
                }
            }
            Err(failure)
        })
    }
}

/// A connection to a member, plain or TLS; it offers no vectored writes (see the module docs).
enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn endpoints_and_tls_files_are_checked_before_connecting() {
        let channel = |endpoints: &[&str], tls: &TlsFiles| {
            let endpoints: Vec<String> = endpoints.iter().map(|e| (*e).to_owned()).collect();
            channel(
                &endpoints,
                tls,
                Duration::from_secs(1),
                crate::connection::KEEP_ALIVE,
            )
        };
        let none = TlsFiles::default();
        assert!(channel(&["http://h:1", "http://h:2"], &none).is_ok());
        assert!(channel(&["https://h:1", "https://[::1]:2"], &none).is_ok());
        for bad in [
            &["http://h:1", "https://h:2"][..],
            &["http://h"],
            &["https://h:port"],
            &["ftp://h:1"],
            &[],
        ] {
            assert!(
                matches!(channel(bad, &none), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
        let ca = |pem: &str| {
            let mut files = TlsFiles::default();
            files.ca = Some(pem.as_bytes().to_vec());
            files
        };
        for pem in ["not a certificate", ""] {
            match channel(&["https://h:1"], &ca(pem)) {
                Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "tls_ca"),
                other => panic!("{pem:?}: {other:?}"),
            }
        }
        assert!(
            matches!(
                channel(&["http://h:1"], &ca("x")),
                Err(Error::InvalidArgument { .. })
            ),
            "TLS files for plain endpoints"
        );
    }
}
