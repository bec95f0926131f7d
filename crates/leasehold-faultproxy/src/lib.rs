//! A TCP fault proxy that delays, cuts, resets or refuses a client's connections.
//!
//! Put it between clients and a server to delay traffic, cut one or both directions while
//! leaving the sockets open (of every connection, or only of those open now: a blackholed
//! link the client could replace), reset every connection, or refuse new ones.
//!
//! Cutting a direction holds its bytes rather than dropping them, as TCP would during a
//! partition: when the link heals they arrive, late. That is what makes late replies,
//! one-way partitions and "the request was applied but the reply never came" reproducible.
//!
//! It is a product crate: `leasehold chaos` puts one in front of each server for each
//! worker, also in front of a user's own servers (`--url`). The testkit re-exports it for
//! the backends' tests.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A direction of traffic through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to server: requests.
    ToServer,
    /// Server to client: replies.
    ToClient,
    /// Both.
    Both,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Link {
    delay: Duration,
    cut: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Faults {
    to_server: Link,
    to_client: Link,
    /// Connections numbered below `.0` (those open when it was set) are cut.
    /// They are cut in the directions `.1` says (to server, to client).
    open_cut: Option<(u64, (bool, bool))>,
    refuse: bool,
    /// Bumped by `reset`: connections from an earlier generation are closed with RST.
    generation: u64,
}

impl Faults {
    /// Whether connection `number`'s `direction` is cut.
    fn cut(&self, number: u64, direction: Direction) -> bool {
        let (link, open) = match direction {
            Direction::ToClient => (self.to_client, self.open_cut.map(|(n, (_, c))| (n, c))),
            _ => (self.to_server, self.open_cut.map(|(n, (s, _))| (n, s))),
        };
        link.cut || open.is_some_and(|(before, cut)| cut && number < before)
    }

    fn links(&mut self, direction: Direction) -> Vec<&mut Link> {
        match direction {
            Direction::ToServer => vec![&mut self.to_server],
            Direction::ToClient => vec![&mut self.to_client],
            Direction::Both => vec![&mut self.to_server, &mut self.to_client],
        }
    }
}

/// A running proxy. Dropping it stops it and closes every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: watch::Sender<Faults>,
    open: Arc<AtomicUsize>,
    /// How many connections were accepted (each is numbered in order from 0).
    accepted: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    ///
    /// # Errors
    ///
    /// If it cannot listen.
    pub async fn start(target: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let faults = watch::Sender::new(Faults::default());
        let open = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept(
            listener,
            target,
            faults.subscribe(),
            open.clone(),
            accepted.clone(),
        ));
        Ok(FaultProxy {
            addr,
            faults,
            open,
            accepted,
            task,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Delays every chunk in `direction` by `delay` (in order).
    pub fn set_delay(&self, direction: Direction, delay: Duration) {
        self.faults.send_modify(|f| {
            for link in f.links(direction) {
                link.delay = delay;
            }
        });
    }

    /// Holds every byte in `direction` until [`heal`](FaultProxy::heal).
    /// Sockets stay open, nobody is told.
    pub fn cut(&self, direction: Direction) {
        self.faults.send_modify(|f| {
            for link in f.links(direction) {
                link.cut = true;
            }
        });
    }

    /// Holds every byte in `direction` of the open connections until [`heal`](FaultProxy::heal).
    /// That is a link that went dead under a client that could open another: connections
    /// made from now on pass.
    pub fn cut_open(&self, direction: Direction) {
        let before = self.accepted.load(Ordering::SeqCst);
        let (to_server, to_client) = match direction {
            Direction::ToServer => (true, false),
            Direction::ToClient => (false, true),
            Direction::Both => (true, true),
        };
        self.faults
            .send_modify(|f| f.open_cut = Some((before, (to_server, to_client))));
    }

    /// Removes delays and cuts; held bytes are delivered. New connections are accepted.
    pub fn heal(&self) {
        self.faults.send_modify(|f| {
            f.to_server = Link::default();
            f.to_client = Link::default();
            f.open_cut = None;
            f.refuse = false;
        });
    }

    /// Closes every open connection with a TCP reset.
    pub fn reset(&self) {
        self.faults.send_modify(|f| f.generation += 1);
    }

    /// While `refuse`, new connections are accepted and closed at once.
    pub fn refuse_new(&self, refuse: bool) {
        self.faults.send_modify(|f| f.refuse = refuse);
    }

    /// How many connections are open through the proxy.
    pub fn connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// How many connections the proxy has accepted since it started.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.reset();
    }
}

async fn accept(
    listener: TcpListener,
    target: SocketAddr,
    faults: watch::Receiver<Faults>,
    open: Arc<AtomicUsize>,
    accepted: Arc<AtomicU64>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let number = accepted.fetch_add(1, Ordering::SeqCst);
        let current = *faults.borrow();
        if current.refuse {
            let _ = client.set_zero_linger();
            continue;
        }
        let faults = faults.clone();
        let open = open.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(target).await else {
                let _ = client.set_zero_linger();
                return;
            };
            open.fetch_add(1, Ordering::SeqCst);
            connection(client, server, faults, current.generation, number).await;
            open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Forwards both ways until either side closes or the proxy resets.
async fn connection(
    client: TcpStream,
    server: TcpStream,
    mut faults: watch::Receiver<Faults>,
    generation: u64,
    number: u64,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // A reset must send RST, not FIN: drop the sockets with zero linger.
    let _ = client.set_zero_linger();
    let _ = server.set_zero_linger();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let both = futures_join(
        pump(
            client_read,
            server_write,
            Direction::ToServer,
            number,
            faults.clone(),
        ),
        pump(
            server_read,
            client_write,
            Direction::ToClient,
            number,
            faults.clone(),
        ),
    );
    tokio::select! {
        _ = both => {}
        _ = faults.wait_for(|f| f.generation != generation) => {}
    }
}

async fn futures_join(a: impl Future<Output = ()>, b: impl Future<Output = ()>) {
    tokio::join!(a, b);
}

/// Copies one direction until its source closes (then passes the close on).
/// A reader stamps chunks as they arrive, a writer delivers each at its stamp plus the
/// delay, and not while the direction is cut.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    direction: Direction,
    number: u64,
    faults: watch::Receiver<Faults>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let write = async move {
        let mut faults = faults;
        while let Some((arrived, chunk)) = rx.recv().await {
            loop {
                let current = *faults.borrow_and_update();
                let link = match direction {
                    Direction::ToClient => current.to_client,
                    _ => current.to_server,
                };
                if current.cut(number, direction) {
                    if faults.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
                let due = arrived + link.delay;
                if Instant::now() >= due {
                    break;
                }
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    changed = faults.changed() => if changed.is_err() { return },
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        // The source closed: pass the close on.
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
