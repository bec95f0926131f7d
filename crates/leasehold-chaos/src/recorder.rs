//! A backend decorator that records every acquire, renewal and release as the server answered it.
//! The server-side view of the history.
//!
//! It sits directly above the real backend (below the engine, and below any planted bug
//! but those of a backend's own arithmetic), so the owner ids, tokens and leases it
//! records are what the server saw and said. For a session it records the backend's
//! deadline and, beside it, the server's own bound the backend reports (the session ttl
//! past the last keep-alive the server acknowledged): C9 holds guards against the latter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold::backend::Liveness;
use leasehold::backend::{
    Acquire, Backend, Capabilities, Expiry as BackendExpiry, LockState, Release, Renewal, Request,
    SessionLiveness, WaitHint,
};
use leasehold::backend::{Eviction, Grant, Mode};
use leasehold::{ListCursor, Listing, LockName, NamePrefix, OwnerId, RecordKey, Result};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::history::{Event, Expiry, Kind, Phase};
use crate::wire::Sink;

/// Records the calls of `inner` to the collector.
#[derive(Debug)]
pub struct Recorder {
    inner: Arc<dyn Backend>,
    sink: Sink,
    /// Sessions seen (their liveness, id, follower).
    sessions: Mutex<Vec<(SessionLiveness, String, JoinHandle<()>)>>,
    /// By owner, when its latest acquire that was answered busy was invoked.
    /// A grant handed to it later is that request's (see [`Backend::handed`]).
    queued: Mutex<HashMap<OwnerId, std::time::Instant>>,
}

impl Recorder {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>, sink: Sink) -> Self {
        Self {
            inner,
            sink,
            sessions: Mutex::new(Vec::new()),
            queued: Mutex::new(HashMap::new()),
        }
    }

    fn expiry(&self, expiry: &BackendExpiry) -> Expiry {
        match expiry {
            BackendExpiry::After(d) => Expiry::After {
                us: u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            },
            BackendExpiry::Never => Expiry::Never,
            BackendExpiry::Session(liveness) => session_expiry(&self.sink, liveness),
        }
    }

    /// The id of the session `liveness` belongs to (`<pid>.<n>`).
    /// Its keep-alives are followed from the first grant on (one follower per session).
    fn follow(&self, liveness: &SessionLiveness) -> String {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, id, _)) = sessions.iter().find(|(l, _, _)| l == liveness) {
            return id.clone();
        }
        let id = format!("{}.{}", std::process::id(), sessions.len());
        let mut follow = liveness.clone();
        let sink = self.sink.clone();
        let session = id.clone();
        let task = tokio::spawn(async move {
            loop {
                follow.changed().await;
                let mut event = sink
                    .event(Kind::Session, Phase::Info)
                    .expiry(session_expiry(&sink, &follow))
                    .value(json!({"session": session}));
                if follow.current() == Liveness::Ended {
                    event = event.answer("ended");
                    sink.send(event);
                    return;
                }
                sink.send(event);
            }
        });
        sessions.push((liveness.clone(), id.clone(), task));
        id
    }

    async fn invoke(&self, kind: Kind, req: &Request) -> Completion {
        let op = self.sink.next_op();
        self.sink
            .invoke(
                self.sink
                    .event(kind, Phase::Invoke)
                    .op(op)
                    .lock(req.name.as_str())
                    .owner(req.owner.to_string()),
            )
            .await;
        Completion {
            sink: self.sink.clone(),
            kind,
            op,
            done: false,
        }
    }
}

/// A session's deadline and the server's own bound, on the collector's timeline.
/// They are instants of the system clock (`CLOCK_BOOTTIME` on Linux); an ended session's
/// deadline is now.
fn session_expiry(sink: &Sink, liveness: &SessionLiveness) -> Expiry {
    let at = |instant: leasehold::clock::Instant| {
        sink.collector_time(u64::try_from(instant.since_origin().as_nanos()).unwrap_or(u64::MAX))
    };
    Expiry::Session {
        until: match liveness.current() {
            Liveness::Alive { until } => at(until),
            Liveness::Ended => sink.collector_time(crate::wire::boottime_ns()),
        },
        server_until: liveness.server_view().map(|view| at(view.until())),
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        for (_, _, task) in sessions.drain(..) {
            task.abort();
        }
    }
}

/// The completion of one recorded call.
/// If the call is dropped before it completes (the engine's timeout), its outcome is
/// recorded as unknown.
struct Completion {
    sink: Sink,
    kind: Kind,
    op: u64,
    done: bool,
}

impl Completion {
    fn event(&self, phase: Phase) -> Event {
        self.sink.event(self.kind, phase).op(self.op)
    }

    fn finish(mut self, event: Event) {
        self.done = true;
        self.sink.send(event);
    }

    fn error(self, error: &leasehold::Error) {
        // Only an error that says the request was refused before anything happened is a
        // failure. Anything else may have been applied — a timeout, a lost connection, and
        // also a backend error that is really one of those (a backend that reports "no
        // response" as an error answer would otherwise make the checks believe a release
        // that happened did not).
        let refused = matches!(
            error,
            leasehold::Error::InvalidArgument { .. }
                | leasehold::Error::Unsupported { .. }
                | leasehold::Error::NotHeld
                | leasehold::Error::Lost(_)
        );
        let phase = if refused { Phase::Fail } else { Phase::Unknown };
        let event = self.event(phase).error(error.to_string());
        self.finish(event);
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.done {
            self.sink.send(
                self.event(Phase::Unknown)
                    .error("cancelled before an answer came"),
            );
        }
    }
}

#[async_trait]
impl Backend for Recorder {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        let invoked = std::time::Instant::now();
        let done = self.invoke(Kind::Acquire, req).await;
        let answer = self.inner.acquire(req).await;
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        match &answer {
            Ok(Acquire::Busy(_)) if req.waiting => queued.insert(req.owner.clone(), invoked),
            _ => queued.remove(&req.owner),
        };
        drop(queued);
        match &answer {
            Ok(Acquire::Granted(grant)) => {
                let mut event = done
                    .event(Phase::Ok)
                    .answer("granted")
                    .token(grant.token.get())
                    .expiry(self.expiry(&grant.expiry));
                if let BackendExpiry::Session(liveness) = &grant.expiry {
                    event = event.value(json!({"session": self.follow(liveness)}));
                }
                done.finish(event);
            }
            Ok(Acquire::Busy(_)) => {
                let event = done.event(Phase::Ok).answer("busy");
                done.finish(event);
            }
            Err(e) => done.error(e),
        }
        answer
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        let done = self.invoke(Kind::Renew, req).await;
        let answer = self.inner.renew(req).await;
        match &answer {
            Ok(Renewal::Renewed(expiry)) => {
                let event = done
                    .event(Phase::Ok)
                    .answer("renewed")
                    .expiry(self.expiry(expiry));
                done.finish(event);
            }
            Ok(Renewal::Lost(reason)) => {
                let mut event = done.event(Phase::Ok).answer("lost");
                event.fault = Some(format!("{reason:?}"));
                done.finish(event);
            }
            Err(e) => done.error(e),
        }
        answer
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        (self.queued.lock().unwrap_or_else(|e| e.into_inner())).remove(&req.owner);
        let done = self.invoke(Kind::Release, req).await;
        let answer = self.inner.release(req).await;
        match &answer {
            Ok(Release::Released) => {
                let event = done.event(Phase::Ok).answer("released");
                done.finish(event);
            }
            Ok(Release::NotHeld) => {
                let event = done.event(Phase::Ok).answer("not_held");
                done.finish(event);
            }
            Err(e) => done.error(e),
        }
        answer
    }

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.inner.wait(name, hint, max).await
    }

    /// Recorded as an acquire granted now, with what is left of the handed lease.
    /// That lease counts from the busy request's invocation (the server counts it from
    /// when that request ran).
    async fn handed(&self, req: &Request, hint: &WaitHint) -> Option<Grant> {
        let grant = self.inner.handed(req, hint).await?;
        let queued = (self.queued.lock().unwrap_or_else(|e| e.into_inner())).remove(&req.owner);
        let done = self.invoke(Kind::Acquire, req).await;
        let left = match (&grant.expiry, queued) {
            (BackendExpiry::After(lease), Some(invoked)) => {
                BackendExpiry::After(lease.saturating_sub(invoked.elapsed()))
            }
            (BackendExpiry::After(_), None) => BackendExpiry::After(Duration::ZERO),
            (other, _) => other.clone(),
        };
        let event = done
            .event(Phase::Ok)
            .answer("granted")
            .token(grant.token.get())
            .expiry(self.expiry(&left));
        done.finish(event);
        Some(grant)
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        self.inner.inspect(name).await
    }

    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        self.inner.list(prefix, cursor, page).await
    }

    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        self.inner.evict(name, mode, eviction).await
    }

    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        self.inner.put_record(req, key, value, keep).await
    }

    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        self.inner.get_record(name, key).await
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        let done = self.invoke(Kind::Release, req).await;
        let answer = self.inner.abandon(req).await;
        match &answer {
            // Given up: the grant ends at some point (the session ends, or a lease runs
            // out), not necessarily now — an unknown outcome for the checks.
            Ok(()) => {
                let event = done.event(Phase::Unknown).answer("abandoned");
                done.finish(event);
            }
            Err(e) => done.error(e),
        }
        answer
    }

    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.inner.session_liveness().await
    }
}
