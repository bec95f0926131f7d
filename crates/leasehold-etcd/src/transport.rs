//! The connection to etcd: one HTTP/2 connection at a time, to one member, moving on to
//! the next member each time it has to connect again (the member it used went away or
//! stopped answering its keep-alive pings).
//!
//! The socket is offered to HTTP/2 without vectored writes. With vectored writes, h2
//! sends any message over 256 bytes (a queueing transaction is about 400) with a write
//! of its own and the end of the stream with another; etcd then wakes twice for one
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
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// A lazily connected channel to the members at `endpoints` (`http://host:port`), with
/// HTTP/2 keep-alive pings every `keep_alive` (the connection is dropped when one goes
/// unanswered as long) so that a paused member is left for the next one.
pub(crate) fn channel(
    endpoints: &[String],
    connect_timeout: Duration,
    keep_alive: Duration,
) -> Result<Channel, tonic::transport::Error> {
    let addresses: Arc<[String]> = endpoints
        .iter()
        .map(|e| e.trim_start_matches("http://").to_owned())
        .collect();
    // Every member gets its share of the connect timeout, which bounds the whole attempt.
    let members = u32::try_from(addresses.len().max(1)).unwrap_or(u32::MAX);
    let connector = Members {
        addresses,
        next: Arc::default(),
        each: connect_timeout / members,
    };
    let endpoint = Endpoint::from_shared(endpoints.first().cloned().unwrap_or_default())?
        .connect_timeout(connect_timeout)
        .http2_keep_alive_interval(keep_alive)
        .keep_alive_timeout(keep_alive)
        .keep_alive_while_idle(true);
    Ok(endpoint.connect_with_connector_lazy(connector))
}

/// Connects to the members in turn, starting after the one connected to last.
#[derive(Clone)]
struct Members {
    addresses: Arc<[String]>,
    next: Arc<AtomicUsize>,
    each: Duration,
}

impl tower_service::Service<Uri> for Members {
    type Response = TokioIo<Unvectored>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let members = self.clone();
        Box::pin(async move {
            let count = members.addresses.len();
            let first = members.next.fetch_add(1, Ordering::Relaxed);
            let mut failure = io::Error::new(io::ErrorKind::NotFound, "no etcd endpoints");
            for turn in 0..count {
                let address = &members.addresses[(first + turn) % count];
                match tokio::time::timeout(members.each, TcpStream::connect(address.as_str())).await
                {
                    Ok(Ok(stream)) => {
                        stream.set_nodelay(true)?;
                        return Ok(TokioIo::new(Unvectored(stream)));
                    }
                    Ok(Err(error)) => failure = error,
                    Err(_) => {
                        failure = io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("connecting to {address} timed out"),
                        );
                    }
                }
            }
            Err(failure)
        })
    }
}

/// A TCP stream that does not offer vectored writes (see the module docs).
struct Unvectored(TcpStream);

impl AsyncRead for Unvectored {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Unvectored {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
