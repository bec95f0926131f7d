//! Lock events: one record per grant, renewal, loss, release and unknown outcome.
//!
//! They are what an auditor of production traffic needs to tell, across hosts, whether two
//! holders' promises overlapped (`docs/audit.md`): who was granted which token, when the
//! request that carried the promise was sent, and what the server promised (a lease counted
//! from that send, or the session's deadline) — on each host's wall clock, whose
//! uncertainty the auditor allows for.
//!
//! Off unless the client is built with a sink ([`ClientBuilder::events`]); then nothing is
//! made for an event but the record itself, handed to the sink as it happens. Sinks:
//! [`JsonLines`] (a file, one object per line, written by a thread of its own so that no
//! lock call waits on the disk) and [`TracingEvents`] (`tracing` events on the target
//! `leasehold::events`, which an OpenTelemetry layer exports as log records).
//!
//! [`ClientBuilder::events`]: crate::ClientBuilder::events

use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::{Expiry, Liveness, Mode, Request};
use crate::clock::Instant;
use crate::context::Context;
use crate::error::{Error, LossReason, Result};
use crate::fencing::FencingToken;
use crate::name::{LockName, OwnerId};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventKind {
    /// The server granted the lock (the guard exists from now on).
    Granted,
    /// A renewal was confirmed: a new promise, counted from its send.
    Renewed,
    /// A renewal got no answer or an error (it is retried until the deadline).
    RenewalFailed,
    /// The guard was lost, for this reason.
    Lost(LossReason),
    /// The holder let go (its release is on its way to the server).
    /// After a [`Lost`](EventKind::Lost), it says that the holder is sending its
    /// owner-checked release of the lost grant (recorded as its first attempt goes out):
    /// had the server kept the grant, that gave it up.
    Released,
    /// The server answered a release: it held no grant for this owner any more.
    /// It had let the grant go before the release came (a lease that ran out, or a server
    /// that ended it early).
    NotHeld,
    /// An acquire request went unanswered: the server may have granted it.
    /// `sent_ms` is when that request was sent. The [`Unknown`](EventKind::Unknown) event
    /// that follows, within `resolved_within` of `sent_ms`, says how it was resolved: by the
    /// answer to a retry, or by a release sent when the client gave up or the acquisition
    /// was dropped.
    Unanswered {
        /// How long after `sent_ms` the outcome is resolved at the latest.
        resolved_within: Duration,
    },
    /// An acquire request went unanswered, and its outcome was resolved so.
    /// `adopted` (a retry found the grant), `not_granted` or `released`. A release is
    /// recorded as its first attempt is sent, also when the acquisition was dropped.
    Unknown(&'static str),
}

impl EventKind {
    /// The kind's name in the records.
    /// It is `granted`, `renewed`, `renewal_failed`, `lost`, `released`, `not_held`,
    /// `unanswered` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Granted => "granted",
            EventKind::Renewed => "renewed",
            EventKind::RenewalFailed => "renewal_failed",
            EventKind::Lost(_) => "lost",
            EventKind::Released => "released",
            EventKind::NotHeld => "not_held",
            EventKind::Unanswered { .. } => "unanswered",
            EventKind::Unknown(_) => "unknown",
        }
    }
}

/// One lock event. Times are milliseconds since the Unix epoch on this host's clock.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LockEvent {
    /// What happened.
    pub kind: EventKind,
    /// When it was recorded.
    pub at_ms: u64,
    /// The same moment on this process's steady clock (see [`steady_ms_now`]).
    pub steady_ms: u64,
    /// The backend's name (`redis`, `etcd`, …).
    pub backend: &'static str,
    /// The lock.
    pub name: LockName,
    /// How it was held or asked for.
    pub mode: Mode,
    /// The acquisition's owner id (one per acquisition).
    pub owner: OwnerId,
    /// The grant's fencing token (`None` for an unknown outcome not adopted).
    pub token: Option<FencingToken>,
    /// When the request behind a grant or renewal was sent.
    pub sent_ms: Option<u64>,
    /// The lease the server promised from `sent_ms`, for a grant or renewal of a lease.
    pub lease_ms: Option<u64>,
    /// The session's deadline, for a grant that lives by a session.
    /// That is on etcd, ZooKeeper and PostgreSQL advisory locks.
    pub session_until_ms: Option<u64>,
}

impl LockEvent {
    /// The event as one JSON object (no line break), as [`JsonLines`] writes it.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(192);
        let _ = write!(
            out,
            r#"{{"kind":"{}","at_ms":{},"steady_ms":{},"backend":"#,
            self.kind.as_str(),
            self.at_ms,
            self.steady_ms
        );
        json_string(&mut out, self.backend);
        out.push_str(r#","name":"#);
        json_string(&mut out, self.name.as_str());
        out.push_str(r#","mode":"#);
        json_string(&mut out, &self.mode.to_string());
        out.push_str(r#","owner":"#);
        json_string(&mut out, self.owner.as_str());
        let number = |out: &mut String, key: &str, value: Option<u64>| {
            if let Some(value) = value {
                let _ = write!(out, r#","{key}":{value}"#);
            }
        };
        number(&mut out, "token", self.token.map(FencingToken::get));
        number(&mut out, "sent_ms", self.sent_ms);
        number(&mut out, "lease_ms", self.lease_ms);
        number(&mut out, "session_until_ms", self.session_until_ms);
        match self.kind {
            EventKind::Lost(reason) => {
                out.push_str(r#","reason":"#);
                json_string(&mut out, &format!("{reason:?}"));
            }
            EventKind::Unknown(resolved) => {
                out.push_str(r#","resolved":"#);
                json_string(&mut out, resolved);
            }
            EventKind::Unanswered { resolved_within } => {
                number(
                    &mut out,
                    "resolved_within_ms",
                    Some(millis(resolved_within)),
                );
            }
            _ => {}
        }
        out.push('}');
        out
    }
}

/// Appends `text` to `out` as a JSON string.
fn json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One access a fence judged: accepted, or refused as stale.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AccessEvent {
    /// When it was judged (ms since the Unix epoch, this host's clock).
    pub at_ms: u64,
    /// The same moment on this process's steady clock (see [`steady_ms_now`]).
    pub steady_ms: u64,
    /// Which kind of fence: `fence` (in process) or `redis`.
    pub fence: &'static str,
    /// What the fence guards, as its owner named it (a Redis fence: its key).
    pub resource: String,
    /// The token presented.
    pub token: FencingToken,
    /// Whether the access went ahead.
    pub accepted: bool,
    /// The highest token the fence had accepted (or excluded up to) when it refused.
    pub highest: Option<FencingToken>,
}

impl AccessEvent {
    /// An access to `resource` behind a `fence` with `token`, judged now.
    pub fn new(
        fence: &'static str,
        resource: &str,
        token: FencingToken,
        accepted: bool,
        highest: Option<FencingToken>,
    ) -> Self {
        Self {
            at_ms: wall_ms_now(),
            steady_ms: steady_ms_now(),
            fence,
            resource: resource.to_owned(),
            token,
            accepted,
            highest,
        }
    }

    /// The event as one JSON object (no line break), as [`JsonLines`] writes it.
    /// Its `kind` is `access`.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(128);
        let _ = write!(
            out,
            r#"{{"kind":"access","at_ms":{},"steady_ms":{},"fence":"#,
            self.at_ms, self.steady_ms
        );
        json_string(&mut out, self.fence);
        out.push_str(r#","resource":"#);
        json_string(&mut out, &self.resource);
        let _ = write!(
            out,
            r#","token":{},"accepted":{}"#,
            self.token.get(),
            self.accepted
        );
        if let Some(highest) = self.highest {
            let _ = write!(out, r#","highest":{}"#, highest.get());
        }
        out.push('}');
        out
    }
}

/// Where events go. Called on the lock path: it must not block.
pub trait EventSink: Send + Sync + fmt::Debug + 'static {
    /// Takes one lock event.
    fn record(&self, event: &LockEvent);

    /// Takes one fence access. The default drops it.
    fn record_access(&self, event: &AccessEvent) {
        let _ = event;
    }
}

/// One sink for many clients: each client's builder gets a clone of the `Arc`.
impl<S: EventSink + ?Sized> EventSink for Arc<S> {
    fn record(&self, event: &LockEvent) {
        (**self).record(event);
    }

    fn record_access(&self, event: &AccessEvent) {
        (**self).record_access(event);
    }
}

/// Milliseconds since the Unix epoch, now.
fn wall_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// This process's steady clock, in ms on the wall clock's scale.
///
/// It reads the wall clock once, at its first use, and from then on adds the monotonic
/// clock's progress to that reading, so a step of the wall clock (an operator, NTP, a VM
/// restored) does not move it. An auditor orders a host's events by it, and sees a step as
/// the gap between it and `at_ms` changing.
///
/// The monotonic clock is the boot-time one, as for lease deadlines: it goes on while the
/// host is suspended, so a resume is no step.
pub fn steady_ms_now() -> u64 {
    use crate::clock::{Clock as _, SystemClock};
    static ANCHOR: std::sync::OnceLock<(Instant, u64)> = std::sync::OnceLock::new();
    let now = SystemClock.now();
    let (anchor, wall) = *ANCHOR.get_or_init(|| (now, wall_ms_now()));
    wall.saturating_add(millis(now.saturating_duration_since(anchor)))
}

/// Records an event of `kind` about `req`'s acquisition, if the client has a sink.
/// `sent` and `expiry` are the request behind a grant or renewal and its answer.
pub(crate) fn record(
    ctx: &Context,
    kind: EventKind,
    req: &Request,
    token: Option<FencingToken>,
    sent: Option<Instant>,
    expiry: Option<&Expiry>,
) {
    let Some(sink) = &ctx.events else {
        return;
    };
    let now = ctx.now();
    let at_ms = wall_ms_now();
    // An instant of the client's clock on the wall clock: as far from now as it is.
    let wall = |instant: Instant| -> u64 {
        let before = millis(now.saturating_duration_since(instant));
        let after = millis(instant.saturating_duration_since(now));
        at_ms.saturating_sub(before).saturating_add(after)
    };
    let (lease_ms, session_until_ms) = match expiry {
        Some(Expiry::After(lease)) => (Some(millis(*lease)), None),
        Some(Expiry::Session(session)) => match session.current() {
            Liveness::Alive { until } => (None, Some(wall(until))),
            Liveness::Ended => (None, Some(at_ms)),
        },
        Some(Expiry::Never) | None => (None, None),
    };
    sink.record(&LockEvent {
        kind,
        at_ms,
        steady_ms: steady_ms_now(),
        backend: ctx.capabilities.backend,
        name: req.name.clone(),
        mode: req.mode,
        owner: req.owner.clone(),
        token,
        sent_ms: sent.map(wall),
        lease_ms,
        session_until_ms,
    });
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Events as JSON lines appended to a file, one object per line.
///
/// A thread of its own writes them, so a lock call never waits on the disk; it writes out
/// what was queued every 50 ms. The queue holds [`JsonLines::QUEUE`] events; when the disk
/// cannot keep up, further events are dropped and counted, and the next line written says
/// how many (`{"kind":"dropped","count":N,…}`), so an auditor knows where the record has a
/// gap. Dropping the sink writes out what is queued.
#[derive(Debug)]
pub struct JsonLines {
    queue: Option<mpsc::SyncSender<String>>,
    dropped: Arc<AtomicU64>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl JsonLines {
    /// Events queued before new ones are dropped.
    pub const QUEUE: usize = 65_536;

    /// Appends to the file at `path` (created if missing).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the file cannot be opened for appending.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::invalid("events file", format!("{}: {e}", path.display())))?;
        let (queue, lines) = mpsc::sync_channel::<String>(Self::QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        let counted = dropped.clone();
        let writer = std::thread::Builder::new()
            .name("leasehold-events".into())
            .spawn(move || write_lines(file, &lines, &counted))
            .map_err(|e| Error::invalid("events file", format!("no writer thread: {e}")))?;
        Ok(Self {
            queue: Some(queue),
            dropped,
            writer: Some(writer),
        })
    }
}

/// How often the writer thread writes out what was queued.
/// Waking for every event would cost a thread switch and a `write` each; a lock event is
/// on disk at most this long after it happened (and at once when the sink is dropped).
const WRITE_EVERY: Duration = Duration::from_millis(50);

/// The writer thread: every [`WRITE_EVERY`], writes every line queued and flushes.
/// It ends once the queue is closed and written out.
fn write_lines(file: std::fs::File, lines: &mpsc::Receiver<String>, dropped: &AtomicU64) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, file);
    loop {
        let closed = loop {
            match lines.try_recv() {
                Ok(line) => {
                    let gap = dropped.swap(0, Ordering::AcqRel);
                    if gap > 0 {
                        let _ = writeln!(
                            out,
                            r#"{{"kind":"dropped","count":{gap},"at_ms":{},"steady_ms":{}}}"#,
                            wall_ms_now(),
                            steady_ms_now()
                        );
                    }
                    let _ = writeln!(out, "{line}");
                }
                Err(mpsc::TryRecvError::Empty) => break false,
                Err(mpsc::TryRecvError::Disconnected) => break true,
            }
        };
        let _ = out.flush();
        if closed {
            return;
        }
        std::thread::park_timeout(WRITE_EVERY);
    }
}

impl JsonLines {
    /// Queues `line`, or counts it dropped.
    fn queue(&self, line: String) {
        let Some(queue) = &self.queue else {
            return;
        };
        if queue.try_send(line).is_err() {
            self.dropped.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl EventSink for JsonLines {
    fn record(&self, event: &LockEvent) {
        self.queue(event.to_json());
    }

    fn record_access(&self, event: &AccessEvent) {
        self.queue(event.to_json());
    }
}

impl Drop for JsonLines {
    fn drop(&mut self) {
        // The writer ends once the queue is closed and written out.
        drop(self.queue.take());
        if let Some(writer) = self.writer.take() {
            writer.thread().unpark();
            let _ = writer.join();
        }
    }
}

/// Events as `tracing` events at level INFO on the target `leasehold::events`.
/// Each has the fields of [`LockEvent`] (`kind`, `lock`, `owner`, `token`, …): an
/// OpenTelemetry layer (`tracing-opentelemetry`, or an appender of the OpenTelemetry log
/// bridge) exports them as log records, a `fmt` layer prints them. Made with
/// `TracingEvents::default()`.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct TracingEvents;

impl EventSink for TracingEvents {
    fn record(&self, event: &LockEvent) {
        let reason = match event.kind {
            EventKind::Lost(reason) => Some(format!("{reason:?}")),
            EventKind::Unknown(resolved) => Some(resolved.to_owned()),
            _ => None,
        };
        let resolved_within_ms = match event.kind {
            EventKind::Unanswered { resolved_within } => Some(millis(resolved_within)),
            _ => None,
        };
        tracing::info!(
            target: "leasehold::events",
            kind = event.kind.as_str(),
            at_ms = event.at_ms,
            steady_ms = event.steady_ms,
            backend = event.backend,
            lock = %event.name,
            mode = %event.mode,
            owner = %event.owner,
            token = event.token.map(FencingToken::get),
            sent_ms = event.sent_ms,
            lease_ms = event.lease_ms,
            session_until_ms = event.session_until_ms,
            reason = reason.as_deref(),
            resolved_within_ms,
            "lock event"
        );
    }

    fn record_access(&self, event: &AccessEvent) {
        tracing::info!(
            target: "leasehold::events",
            kind = "access",
            at_ms = event.at_ms,
            steady_ms = event.steady_ms,
            fence = event.fence,
            resource = %event.resource,
            token = event.token.get(),
            accepted = event.accepted,
            highest = event.highest.map(FencingToken::get),
            "fence access"
        );
    }
}
