//! The collector: every process of a run sends it events.
//! It stamps each with its own monotonic clock, keeps the history, and keeps a live view of
//! who holds and who waits (the nemesis aims at it). It also carries the runner's commands
//! to workers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::history::{Event, History, Kind, Phase};
use crate::wire::{Command, Down, Up, boottime_ns, send_line};

/// A worker holding the lock, as far as the collector has heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Its guard's owner id.
    pub owner: String,
    /// Its token.
    pub token: u64,
    /// Since when (collector time, µs).
    pub since: u64,
}

/// Who holds, who waits, who is connected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveView {
    /// Workers holding a guard.
    pub holders: BTreeMap<String, Held>,
    /// Workers inside a lock call.
    pub waiting: BTreeSet<String>,
    /// Connected processes and their pids.
    pub connected: BTreeMap<String, u32>,
    /// Accesses the resource accepted so far.
    pub accepted: u64,
    /// When each worker's lease was last renewed (collector time, µs).
    pub renewed: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct Shared {
    origin_ns: u64,
    log: Mutex<Log>,
    view: watch::Sender<LiveView>,
    /// How many events were recorded: bumped by each.
    recorded: watch::Sender<u64>,
    clients: Mutex<HashMap<String, mpsc::UnboundedSender<Down>>>,
}

#[derive(Debug, Default)]
struct Log {
    seq: u64,
    events: Vec<Event>,
}

/// A running collector. Dropping it stops accepting connections.
#[derive(Debug)]
pub struct Collector {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Collector {
    /// Listens on a loopback port; the run's clock starts now.
    ///
    /// # Cancel safety
    ///
    /// Nothing is left listening if the future is dropped.
    ///
    /// # Errors
    ///
    /// If it cannot listen.
    pub async fn start() -> io::Result<Collector> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            origin_ns: boottime_ns(),
            log: Mutex::default(),
            view: watch::Sender::new(LiveView::default()),
            recorded: watch::Sender::new(0),
            clients: Mutex::default(),
        });
        let task = tokio::spawn(accept(listener, shared.clone()));
        Ok(Collector { addr, shared, task })
    }

    /// Where processes connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The collector's clock now: µs since the run began.
    pub fn now(&self) -> u64 {
        boottime_ns().saturating_sub(self.shared.origin_ns) / 1000
    }

    /// Records an event of the runner's own (nemesis, observer, runner); returns its stamp.
    pub fn record(&self, event: Event) -> u64 {
        self.shared.stamp(event)
    }

    /// Sends `command` to `process`; false if it is not connected.
    pub fn command(&self, process: &str, command: Command) -> bool {
        self.shared
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(process)
            .is_some_and(|c| c.send(Down::Command(command)).is_ok())
    }

    /// A handle that records events from other tasks.
    pub fn handle(&self) -> CollectorHandle {
        CollectorHandle(self.shared.clone())
    }

    /// The live view, to watch.
    pub fn view(&self) -> watch::Receiver<LiveView> {
        self.shared.view.subscribe()
    }

    /// The history so far.
    pub fn history(&self) -> History {
        let log = self.shared.log.lock().unwrap_or_else(|e| e.into_inner());
        History::new(log.events.clone())
    }

    /// Waits until an event of `kind` is recorded, for at most `limit`.
    ///
    /// Returns whether one was.
    ///
    /// # Cancel safety
    ///
    /// It only reads.
    pub async fn until_recorded(&self, kind: Kind, limit: Duration) -> bool {
        let mut recorded = self.shared.recorded.subscribe();
        let seen = async {
            loop {
                recorded.borrow_and_update();
                if self.has_recorded(kind) {
                    return;
                }
                if recorded.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        };
        tokio::time::timeout(limit, seen).await.is_ok()
    }

    fn has_recorded(&self, kind: Kind) -> bool {
        let log = self.shared.log.lock().unwrap_or_else(|e| e.into_inner());
        log.events.iter().any(|e| e.kind == Some(kind))
    }

    /// How many events so far.
    pub fn len(&self) -> usize {
        self.shared
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .len()
    }

    /// Whether nothing was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Records events into a collector from any task.
#[derive(Debug, Clone)]
pub struct CollectorHandle(Arc<Shared>);

impl CollectorHandle {
    /// Records an event; returns its stamp.
    pub fn record(&self, event: Event) -> u64 {
        self.0.stamp(event)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Shared {
    fn stamp(&self, mut event: Event) -> u64 {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        // Read the clock under the lock: stamps and arrival order agree.
        let t = boottime_ns().saturating_sub(self.origin_ns) / 1000;
        event.t = t;
        event.seq = log.seq;
        log.seq += 1;
        self.view.send_if_modified(|view| update(view, &event));
        log.events.push(event);
        self.recorded.send_replace(log.seq);
        t
    }
}

/// Follows guards and waits in the live view.
fn update(view: &mut LiveView, e: &Event) -> bool {
    let process = e.process.clone();
    match (e.kind(), e.phase()) {
        (Kind::Lock, Phase::Invoke) => view.waiting.insert(process),
        (Kind::Lock, Phase::Ok) => {
            view.waiting.remove(&process);
            view.holders.insert(
                process,
                Held {
                    owner: e.owner.clone().unwrap_or_default(),
                    token: e.token.unwrap_or(0),
                    since: e.t,
                },
            );
            true
        }
        (Kind::Lock, _) => view.waiting.remove(&process),
        (Kind::Unlock, Phase::Invoke) | (Kind::Lost, _) => {
            let mine = view
                .holders
                .get(&process)
                .is_some_and(|h| e.owner.is_none() || e.owner.as_ref() == Some(&h.owner));
            mine && view.holders.remove(&process).is_some()
        }
        (Kind::Renew, Phase::Ok) if e.answer.as_deref() == Some("renewed") => {
            view.renewed.insert(process, e.t);
            true
        }
        (Kind::Apply, _) if e.answer.as_deref() == Some("accepted") => {
            view.accepted += 1;
            true
        }
        _ => false,
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(serve(stream, shared.clone()));
    }
}

async fn serve(stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let Ok(Some(first)) = lines.next_line().await else {
        return;
    };
    let Ok(Up::Hello { process, pid }) = serde_json::from_str::<Up>(&first) else {
        return;
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Down>();
    let _ = tx.send(Down::Welcome {
        origin_ns: shared.origin_ns,
    });
    shared
        .clients
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(process.clone(), tx.clone());
    shared.view.send_modify(|v| {
        v.connected.insert(process.clone(), pid);
    });
    let writer = tokio::spawn(async move {
        while let Some(message) = rx.recv().await {
            if send_line(&mut write, &message).await.is_err() {
                return;
            }
        }
    });
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(Up::Event { mut event, ack }) = serde_json::from_str::<Up>(&line) else {
            continue;
        };
        event.process.clone_from(&process);
        let t = shared.stamp(*event);
        if ack {
            let _ = tx.send(Down::Ack { t });
        }
    }
    // The process is gone (exited, killed): it holds and waits for nothing any more.
    shared.view.send_modify(|v| {
        v.connected.remove(&process);
        v.holders.remove(&process);
        v.waiting.remove(&process);
    });
    let mut clients = shared.clients.lock().unwrap_or_else(|e| e.into_inner());
    if clients.get(&process).is_some_and(|c| c.same_channel(&tx)) {
        clients.remove(&process);
    }
    drop(clients);
    writer.abort();
}
