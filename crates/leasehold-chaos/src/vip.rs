//! A movable address.
//! A TCP forwarder whose target can be switched, as a floating IP or a Sentinel-aware proxy
//! would after a failover. Switching closes every open connection, so clients reconnect to
//! the new target.

use std::io;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A running forwarder; dropping it closes everything.
#[derive(Debug)]
pub struct Vip {
    addr: SocketAddr,
    target: watch::Sender<SocketAddr>,
    task: JoinHandle<()>,
}

impl Vip {
    /// Listens on a loopback port and forwards to `target`.
    ///
    /// # Cancel safety
    ///
    /// Nothing is left listening if the future is dropped.
    ///
    /// # Errors
    ///
    /// If it cannot listen.
    pub async fn start(target: SocketAddr) -> io::Result<Vip> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let target = watch::Sender::new(target);
        let task = tokio::spawn(accept(listener, target.subscribe()));
        Ok(Vip { addr, target, task })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Points the address at `target`; open connections are closed.
    pub fn switch(&self, target: SocketAddr) {
        self.target.send_replace(target);
    }
}

impl Drop for Vip {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, target: watch::Receiver<SocketAddr>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let mut target = target.clone();
        tokio::spawn(async move {
            let to = *target.borrow_and_update();
            let Ok(mut server) = TcpStream::connect(to).await else {
                return;
            };
            let mut client = client;
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                _ = target.changed() => {}
            }
        });
    }
}
