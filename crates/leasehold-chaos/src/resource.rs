//! The fenced resource: a process that applies reads and writes carrying a fencing token.
//! It runs in `enforce` mode (refuse a token lower than the highest it accepted) or
//! `observe` mode (accept everything and record). It logs every access to the collector
//! before answering, in the order it applied them.
//!
//! Reads are fenced too: a read-modify-write workload reads under its token, and a read
//! with a newer token makes every older holder's later write stale.
//!
//! With a [`StillOwnerCheck`] (PostgreSQL) the resource also checks every access with
//! `still_owner`, as a service keeping its data next to the locks would: each hold of a
//! worker is one transaction of the resource's, opened at its first access and ended when
//! the worker says the hold is over (or its connection closes). An access the check refuses
//! is refused, whatever its token.
//!
//! With `events` it also writes an `access` event per access to a JSON-lines file (fence
//! `chaos`, resource `resource`), as a shipped fence does: `leasehold audit` reads it beside
//! the workers' lock events.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use leasehold::FencingToken;
use leasehold::events::{AccessEvent, EventSink, JsonLines};
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
    /// Also check accesses with `still_owner`.
    #[serde(default)]
    pub still_owner: Option<StillOwnerCheck>,
    /// Where to write an `access` event per access, if anywhere (see the module docs).
    #[serde(default)]
    pub events: Option<PathBuf>,
}

/// What every connection of the resource shares.
struct Served {
    config: ResourceConfig,
    /// The access events' sink, if the config names a file.
    events: Option<JsonLines>,
}

/// Where the resource checks accesses with `still_owner`: the lock's PostgreSQL database.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StillOwnerCheck {
    /// The database (the lock tables' schema is the default one).
    pub url: String,
    /// The lock's name.
    pub lock: String,
}

/// One worker connection's transaction, for [`StillOwnerCheck`]: the hold it is for.
#[derive(Default)]
struct HoldTransaction {
    client: Option<leasehold::postgres::tokio_postgres::Client>,
    /// The owner and token of the hold whose transaction is open.
    open: Option<(String, u64)>,
}

impl HoldTransaction {
    /// Whether `req`'s grant is still current, checked in its hold's transaction.
    /// The transaction is opened now if needed. A check that cannot be made refuses.
    async fn holds(
        &mut self,
        check: &StillOwnerCheck,
        req: &ResourceRequest,
    ) -> Result<bool, String> {
        let hold = (req.owner.clone(), req.token);
        if self.open.as_ref() != Some(&hold) {
            self.end().await;
        }
        let answer = async {
            let client = match &self.client {
                Some(client) if !client.is_closed() => client,
                _ => {
                    let (client, connection) = leasehold::postgres::tokio_postgres::connect(
                        &check.url,
                        leasehold::postgres::tokio_postgres::NoTls,
                    )
                    .await?;
                    tokio::spawn(connection);
                    self.open = None;
                    self.client.insert(client)
                }
            };
            if self.open.is_none() {
                client.batch_execute("BEGIN").await?;
                self.open = Some(hold);
            }
            let fence = leasehold::postgres::StillOwner::of_grant(
                &check.lock,
                leasehold::FencingToken::new(req.token),
                &req.owner,
            );
            let row = client
                .query_one(
                    &format!("SELECT {}", fence.condition(1)),
                    &[&fence.name(), &fence.token(), &fence.owner()],
                )
                .await?;
            row.try_get::<_, bool>(0)
        };
        answer
            .await
            .map_err(|e: leasehold::postgres::tokio_postgres::Error| {
                // The transaction is gone with the failed statement: start afresh.
                self.client = None;
                self.open = None;
                e.to_string()
            })
    }

    /// Ends the open transaction, if any.
    async fn end(&mut self) {
        if self.open.take().is_some()
            && let Some(client) = &self.client
            && client.batch_execute("COMMIT").await.is_err()
        {
            self.client = None;
        }
    }
}

#[derive(Debug)]
struct State {
    value: Value,
    highest: Option<u64>,
}

/// Runs the resource: prints `listening <addr>`, then serves until stdin closes.
/// It prints on stdout; stdin closes when the runner dies or ends the run.
///
/// # Cancel safety
///
/// Dropping the future stops serving; the state is lost. When stdin closes it returns, and
/// its access events are written out.
///
/// # Errors
///
/// If it cannot listen, reach the collector or open the events file.
pub async fn serve(config: ResourceConfig) -> io::Result<()> {
    let events = match &config.events {
        Some(path) => Some(JsonLines::create(path).map_err(io::Error::other)?),
        None => None,
    };
    let (sink, _commands) = Sink::connect(config.collector, "resource", 0).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("listening {}", listener.local_addr()?);
    let state = Arc::new(AsyncMutex::new(State {
        value: config.workload.initial(),
        highest: None,
    }));
    let served = Arc::new(Served { config, events });
    let accept = async {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(connection(
                stream,
                state.clone(),
                sink.clone(),
                served.clone(),
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
    served: Arc<Served>,
) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    // Dropped with the connection: an open transaction is rolled back.
    let mut hold = HoldTransaction::default();
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(req) = serde_json::from_str::<ResourceRequest>(&line) else {
            return;
        };
        let checked = match &served.config.still_owner {
            Some(_) if req.op == "end" => {
                hold.end().await;
                let reply = ResourceReply {
                    id: req.id,
                    ok: true,
                    value: Value::Null,
                    highest: None,
                };
                if send_line(&mut write, &reply).await.is_err() {
                    return;
                }
                continue;
            }
            Some(check) if req.op != "final" => Some(hold.holds(check, &req).await),
            _ => None,
        };
        let reply = apply(&req, &state, &sink, &served, checked).await;
        if send_line(&mut write, &reply).await.is_err() {
            return;
        }
    }
}

/// Applies `req`, unless its token is stale (enforce mode) or `still_owner` refused it.
/// `checked`: the check's answer, if one was made.
async fn apply(
    req: &ResourceRequest,
    state: &AsyncMutex<State>,
    sink: &Sink,
    served: &Served,
    checked: Option<Result<bool, String>>,
) -> ResourceReply {
    let config = &served.config;
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
    let still_owner = checked.as_ref().is_none_or(|c| c == &Ok(true));
    let accepted = (!stale || config.mode == FenceMode::Observe) && still_owner;
    let mut event = sink
        .event(Kind::Apply, Phase::Info)
        .op(req.id)
        .owner(req.owner.clone())
        .token(req.token)
        .answer(if accepted { "accepted" } else { "refused" });
    event.error = match checked {
        Some(Ok(false)) => Some("still_owner: the grant is not current".into()),
        Some(Err(error)) => Some(format!("still_owner could not check: {error}")),
        _ => None,
    };
    if let Some(events) = &served.events {
        // The highest token only where the access was refused as stale.
        let highest = state.highest.filter(|_| stale && !accepted);
        let highest = highest.map(FencingToken::new);
        let token = FencingToken::new(req.token);
        events.record_access(&AccessEvent::new(
            "chaos", "resource", token, accepted, highest,
        ));
    }
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

/// A worker's connection to the resource.
/// Requests time out; a connection that failed is opened again on the next request.
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

    /// Sends `req`, waits for its answer; no answer within the timeout is [`Access::Unknown`].
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
