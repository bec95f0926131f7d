//! A decorator that injects faults between the engine and any backend.
//!
//! [`Faulty`] wraps a real backend (in-memory in unit tests, a real server in integration
//! tests) and, per operation, can hold requests before they reach the server (a dead or
//! partitioned link: nothing is applied), hold, delay or lose replies after the server
//! applied the request (the outcome is unknown to the caller), or fail the next calls with
//! a chosen error. It counts calls, and tests can await a call count instead of
//! sleeping.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use leasehold_core::backend::{
    Acquire, Backend, Capabilities, LockState, Release, Renewal, Request, SessionLiveness, WaitHint,
};
use leasehold_core::backend::{Changes, Eviction, Grant, Mode};
use leasehold_core::{Error, ListCursor, Listing, LockName, NamePrefix, RecordKey, Result};

/// A backend operation, for [`Faulty`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Backend::acquire`].
    Acquire,
    /// [`Backend::renew`].
    Renew,
    /// [`Backend::renew_many`]: a batch, whose renewals are each a [`Op::Renew`] too.
    RenewMany,
    /// [`Backend::release`].
    Release,
    /// [`Backend::wait`].
    Wait,
    /// [`Backend::inspect`].
    Inspect,
    /// [`Backend::list`].
    List,
}

/// A backend decorator that injects faults. Clones share the faults.
///
/// ```
/// use leasehold_core::{Client, Error, memory::InMemory};
/// use leasehold_testkit::faulty::{Faulty, Op};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let faulty = Faulty::new(InMemory::new());
/// let client = Client::new(faulty.clone());
/// faulty.fail_next(Op::Acquire, Error::backend("READONLY You can't write against a read only replica.", false));
/// assert!(matches!(client.mutex("m")?.lock().await, Err(Error::Backend { .. })));
/// assert!(client.mutex("m")?.try_lock().await?.is_some());
/// assert_eq!(faulty.calls(Op::Acquire), 2);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Faulty {
    inner: Arc<dyn Backend>,
    faults: Arc<Faults>,
}

#[derive(Default)]
struct Faults {
    ops: Mutex<HashMap<Op, OpFaults>>,
    /// Bumped on every call and every fault change; held calls and call-count waiters watch it.
    changes: watch::Sender<u64>,
}

#[derive(Default)]
struct OpFaults {
    hold_requests: bool,
    hold_replies: bool,
    delay: Duration,
    fail_next: VecDeque<Error>,
    lose_replies: u32,
    calls: u64,
}

impl Faulty {
    /// Wraps `inner`, with no faults.
    pub fn new(inner: impl Backend) -> Self {
        Self::wrap(Arc::new(inner))
    }

    /// Wraps a backend already behind an `Arc`.
    pub fn wrap(inner: Arc<dyn Backend>) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    fn change(&self, op: Op, f: impl FnOnce(&mut OpFaults)) {
        {
            let mut ops = self.faults.ops.lock().unwrap_or_else(|e| e.into_inner());
            f(ops.entry(op).or_default());
        }
        self.faults.changes.send_modify(|n| *n += 1);
    }

    fn read<T>(&self, op: Op, f: impl FnOnce(&OpFaults) -> T) -> T {
        let mut ops = self.faults.ops.lock().unwrap_or_else(|e| e.into_inner());
        f(ops.entry(op).or_default())
    }

    /// Calls of `op` wait before reaching the backend until [`resume`](Faulty::resume).
    /// That is a dead link: nothing is applied while held.
    pub fn hold_requests(&self, op: Op) {
        self.change(op, |f| f.hold_requests = true);
    }

    /// Calls of `op` are applied by the backend, but their replies wait.
    /// They wait until [`resume`](Faulty::resume): lost or late replies.
    pub fn hold_replies(&self, op: Op) {
        self.change(op, |f| f.hold_replies = true);
    }

    /// Every reply of `op` is delayed by `delay` after the backend answered.
    pub fn delay_replies(&self, op: Op, delay: Duration) {
        self.change(op, |f| f.delay = delay);
    }

    /// Lets held requests and replies of `op` through and stops holding new ones.
    pub fn resume(&self, op: Op) {
        self.change(op, |f| {
            f.hold_requests = false;
            f.hold_replies = false;
            f.delay = Duration::ZERO;
        });
    }

    /// The next call of `op` fails with `error` without reaching the backend.
    /// Failures queue: call it several times to fail several calls.
    pub fn fail_next(&self, op: Op, error: Error) {
        self.change(op, |f| f.fail_next.push_back(error));
    }

    /// The next call of `op` is applied by the backend but its reply never comes.
    /// The caller sees no answer (queued like [`fail_next`](Faulty::fail_next)).
    pub fn lose_next_reply(&self, op: Op) {
        self.change(op, |f| f.lose_replies += 1);
    }

    /// How many calls of `op` were made so far.
    pub fn calls(&self, op: Op) -> u64 {
        self.read(op, |f| f.calls)
    }

    /// Waits until at least `n` calls of `op` were made.
    pub async fn until_calls(&self, op: Op, n: u64) {
        let mut changes = self.faults.changes.subscribe();
        while self.calls(op) < n {
            // The sender lives in `self`.
            let _ = changes.changed().await;
        }
    }

    async fn held(&self, op: Op, which: fn(&OpFaults) -> bool) {
        let mut changes = self.faults.changes.subscribe();
        while self.read(op, which) {
            let _ = changes.changed().await;
        }
    }

    async fn intercept<T>(&self, op: Op, call: impl Future<Output = Result<T>>) -> Result<T> {
        let (failure, lose_reply) = {
            let mut ops = self.faults.ops.lock().unwrap_or_else(|e| e.into_inner());
            let f = ops.entry(op).or_default();
            f.calls += 1;
            let lose_reply = f.lose_replies > 0;
            f.lose_replies = f.lose_replies.saturating_sub(1);
            (f.fail_next.pop_front(), lose_reply)
        };
        self.faults.changes.send_modify(|n| *n += 1);
        if let Some(error) = failure {
            return Err(error);
        }
        self.held(op, |f| f.hold_requests).await;
        let answer = call.await;
        if lose_reply {
            std::future::pending::<()>().await;
        }
        self.held(op, |f| f.hold_replies).await;
        let delay = self.read(op, |f| f.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        answer
    }
}

impl fmt::Debug for Faulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faulty")
            .field("inner", &self.inner)
            .finish()
    }
}

#[async_trait]
impl Backend for Faulty {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        self.intercept(Op::Acquire, self.inner.acquire(req)).await
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        self.intercept(Op::Renew, self.inner.renew(req)).await
    }

    /// A batch is one [`Op::RenewMany`] call made of one [`Op::Renew`] call per request.
    /// So faults set on renewals apply to batched ones too (the inner backend's own batch is
    /// not used). Failing a batch fails each of its renewals.
    async fn renew_many(&self, reqs: &[&Request]) -> Vec<Result<Renewal>> {
        let each = futures_util::future::join_all(reqs.iter().map(|req| self.renew(req)));
        match self
            .intercept(Op::RenewMany, async { Ok(each.await) })
            .await
        {
            Ok(answers) => answers,
            Err(error) => vec![Err(error); reqs.len()],
        }
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        self.intercept(Op::Release, self.inner.release(req)).await
    }

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.intercept(Op::Wait, self.inner.wait(name, hint, max))
            .await
    }

    /// Passed on as it is: a grant handed over comes with a wake-up, not an acquire's reply.
    async fn handed(&self, req: &Request, hint: &WaitHint) -> Option<Grant> {
        self.inner.handed(req, hint).await
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        self.intercept(Op::Inspect, self.inner.inspect(name)).await
    }

    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        self.intercept(Op::List, self.inner.list(prefix, cursor, page))
            .await
    }

    async fn evict(&self, name: &LockName, mode: Mode, eviction: &Eviction) -> Result<bool> {
        self.inner.evict(name, mode, eviction).await
    }

    async fn changes(&self, prefix: &NamePrefix) -> Result<Changes> {
        self.inner.changes(prefix).await
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

    async fn keep(&self, req: &Request, hold: Duration) -> Result<bool> {
        self.inner.keep(req, hold).await
    }

    async fn abandon(&self, req: &Request) -> Result<()> {
        self.inner.abandon(req).await
    }
    async fn session_liveness(&self) -> Option<SessionLiveness> {
        self.inner.session_liveness().await
    }
}
