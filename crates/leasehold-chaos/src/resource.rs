//! The fenced resource: a process of its own that applies reads and writes carrying a
//! fencing token, in `enforce` mode (refuse a token lower than the highest it accepted)
//! or `observe` mode (accept everything and record). It logs every access to the
//! collector before answering, in the order it applied them.
//!
//! Reads are fenced too: a read-modify-write workload reads under its token, and a read
//! with a newer token makes every older holder's later write stale.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex as AsyncMutex;

use crate::history::{Kind, Phase};
use crate::wire::{ResourceReply, ResourceRequest, Sink, send_line};

/// Whether the resource refuses stale tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FenceMode {
    /// Refuse a token lower than the highest accepted.
    #[default]
    Enforce,
    /// Accept everything, record everything.
    Observe,
}

impl FenceMode {
    /// `enforce` or `observe`.
    pub fn as_str(self) -> &'static str {
        match self {
            FenceMode::Enforce => "enforce",
            FenceMode::Observe => "observe",
        }
    }
}

/// What the workers do under the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Read a counter, write it back incremented.
    #[default]
    Counter,
    /// Read a set (a list), write it back with a unique element appended.
    Set,
}

impl Workload {
    /// `counter` or `set`.
    pub fn as_str(self) -> &'static str {
        match self {
            Workload::Counter => "counter",
            Workload::Set => "set",
        }
    }

    /// The initial value.
    pub fn initial(self) -> Value {
        match self {
            Workload::Counter => json!(0),
            Workload::Set => json!([]),
        }
    }
}

/// How the resource process is started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResourceConfig {
    /// The collector.
    pub collector: SocketAddr,
    /// Enforce or observe.
    pub mode: FenceMode,
    /// The workload (for the initial value and the final report).
    pub workload: Workload,
}

#[derive(Debug)]
struct State {
    value: Value,
    highest: Option<u64>,
}

/// Runs the resource: prints `listening <addr>` on stdout, then serves until stdin closes
/// (the runner dies or ends the run).
///
/// # Cancel safety
///
/// Dropping the future stops serving; the state is lost.
///
/// # Errors
///
/// If it cannot listen or reach the collector.
pub async fn serve(config: ResourceConfig) -> io::Result<()> {
    let (sink, _commands) = Sink::connect(config.collector, "resource", 0).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("listening {}", listener.local_addr()?);
    let state = Arc::new(AsyncMutex::new(State {
        value: config.workload.initial(),
        highest: None,
    }));
    let config = Arc::new(config);
    let accept = async {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(connection(
                stream,
                state.clone(),
                sink.clone(),
                config.clone(),
            ));
        }
    };
    // Stdin closes when the runner goes away.
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    let eof = async {
        while tokio::io::AsyncReadExt::read(&mut stdin, &mut buf)
            .await
            .is_ok_and(|n| n > 0)
        {}
    };
    tokio::select! {
        () = accept => {}
        () = eof => {}
    }
    Ok(())
}

async fn connection(
    stream: TcpStream,
    state: Arc<AsyncMutex<State>>,
    sink: Sink,
    config: Arc<ResourceConfig>,
) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(req) = serde_json::from_str::<ResourceRequest>(&line) else {
            return;
        };
        let reply = apply(&req, &state, &sink, &config).await;
        if send_line(&mut write, &reply).await.is_err() {
            return;
        }
    }
}

async fn apply(
    req: &ResourceRequest,
    state: &AsyncMutex<State>,
    sink: &Sink,
    config: &ResourceConfig,
) -> ResourceReply {
    let mut state = state.lock().await;
    if req.op == "final" {
        let value = json!({"workload": config.workload.as_str(), "value": state.value, "highest": state.highest});
        sink.send(sink.event(Kind::Final, Phase::Info).value(value.clone()));
        return ResourceReply {
            id: req.id,
            ok: true,
            value,
            highest: state.highest,
        };
    }
    let stale = state.highest.is_some_and(|h| req.token < h);
    let accepted = !stale || config.mode == FenceMode::Observe;
    let mut event = sink
        .event(Kind::Apply, Phase::Info)
        .op(req.id)
        .owner(req.owner.clone())
        .token(req.token)
        .answer(if accepted { "accepted" } else { "refused" });
    event.worker = Some(req.worker.clone());
    event.target = Some(req.op.clone());
    let value = if req.op == "write" {
        if accepted {
            event.prev = Some(state.value.clone());
            state.value = req.value.clone();
        }
        state.value.clone()
    } else {
        state.value.clone()
    };
    if accepted {
        state.highest = Some(state.highest.map_or(req.token, |h| h.max(req.token)));
    }
    event.value = Some(value.clone());
    // Logged before the answer leaves, in application order (one connection, under the
    // state's lock).
    sink.send(event);
    ResourceReply {
        id: req.id,
        ok: accepted,
        value,
        highest: state.highest,
    }
}

type Connection = (
    BufReader<tokio::net::tcp::OwnedReadHalf>,
    tokio::net::tcp::OwnedWriteHalf,
);

/// A worker's connection to the resource. Requests time out; a connection that failed is
/// opened again on the next request.
#[derive(Debug)]
pub struct ResourceClient {
    addr: SocketAddr,
    timeout: Duration,
    stream: AsyncMutex<Option<Connection>>,
}

/// The outcome of one access.
#[derive(Debug, Clone, PartialEq)]
pub enum Access {
    /// Accepted; the value read (or written).
    Accepted(Value),
    /// Refused: a newer token was accepted before.
    Refused,
    /// No answer: it may or may not have been applied.
    Unknown(String),
}

impl ResourceClient {
    /// A client of the resource at `addr`.
    pub fn new(addr: SocketAddr, timeout: Duration) -> Self {
        Self {
            addr,
            timeout,
            stream: AsyncMutex::new(None),
        }
    }

    /// Sends `req`, waits for its answer; no answer within the timeout is
    /// [`Access::Unknown`].
    ///
    /// # Cancel safety
    ///
    /// A request already sent may be applied; the connection is opened again next time.
    pub async fn call(&self, req: &ResourceRequest) -> Access {
        let mut guard = self.stream.lock().await;
        let attempt = async {
            if guard.is_none() {
                let stream = TcpStream::connect(self.addr).await?;
                stream.set_nodelay(true)?;
                let (r, w) = stream.into_split();
                *guard = Some((BufReader::new(r), w));
            }
            let Some((read, write)) = guard.as_mut() else {
                return Err(io::Error::other("no connection"));
            };
            send_line(write, req).await?;
            write.flush().await?;
            let mut line = String::new();
            if read.read_line(&mut line).await? == 0 {
                return Err(io::Error::other("the resource closed the connection"));
            }
            let reply: ResourceReply = serde_json::from_str(&line)?;
            Ok(reply)
        };
        let answer = tokio::time::timeout(self.timeout, attempt).await;
        match answer {
            Ok(Ok(reply)) if reply.ok => Access::Accepted(reply.value),
            Ok(Ok(_)) => Access::Refused,
            Ok(Err(e)) => {
                *guard = None;
                Access::Unknown(e.to_string())
            }
            Err(_) => {
                *guard = None;
                Access::Unknown(format!("no answer within {:?}", self.timeout))
            }
        }
    }
}
