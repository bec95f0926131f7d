//! The engine's runtime context: what every acquisition of one client shares.
//! Its acquisitions, leases, renewals and releases share the backend, the clock, the
//! default options, the renewal schedule and the background tasks that
//! [`Client::settle`](crate::Client::settle) waits for.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::backend::{Backend, Capabilities};
use crate::clock::{Clock, Instant};
use crate::error::{Error, Result};
use crate::events::EventSink;
use crate::lease::Lease;
use crate::options::LockOptions;
use crate::watchdog::Watchdog;

/// One client's engine state. [`Client`](crate::Client) is a facade over it.
pub(crate) struct Context {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) capabilities: Capabilities,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) options: Arc<LockOptions>,
    /// The renewal schedule of this client's leases.
    pub(crate) watchdog: Arc<Watchdog<Lease>>,
    /// The lanes of this client's current acquisitions.
    pub(crate) lanes: Arc<Lanes>,
    /// Where lock events go, if anywhere ([`crate::events`]).
    pub(crate) events: Option<Arc<dyn EventSink>>,
    /// How many background tasks run.
    background: watch::Sender<usize>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("backend", &self.backend)
            .field("clock", &self.clock)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Context {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
        options: LockOptions,
        events: Option<Arc<dyn EventSink>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            capabilities: backend.capabilities(),
            backend,
            watchdog: Arc::new(Watchdog::new(clock.clone())),
            lanes: Arc::new(Lanes::from(rand::random::<u32>())),
            clock,
            options: Arc::new(options),
            events,
            background: watch::Sender::new(0),
        })
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Runs `request` with a time limit.
    /// No answer in time is [`Error::Timeout`] (an unknown outcome).
    pub(crate) async fn call<T>(
        &self,
        limit: Duration,
        request: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(limit, request)
            .await
            .unwrap_or(Err(Error::Timeout(limit)))
    }

    /// Runs `task` in the background on `runtime`; [`settle`](Context::settle) waits for it.
    pub(crate) fn spawn_background(
        &self,
        runtime: &Handle,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        struct Pending(watch::Sender<usize>);
        impl Drop for Pending {
            fn drop(&mut self) {
                self.0.send_modify(|n| *n -= 1);
            }
        }
        self.background.send_modify(|n| *n += 1);
        let pending = Pending(self.background.clone());
        // If the runtime is shutting down the task is dropped unrun, and `pending` with it.
        runtime.spawn(async move {
            let _pending = pending;
            task.await;
        });
    }

    /// Waits until no background task runs.
    pub(crate) async fn settle(&self) {
        let mut rx = self.background.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = rx.wait_for(|pending| *pending == 0).await;
    }
}

/// The lane numbers of a client's current acquisitions.
/// See [`Request::lane`](crate::backend::Request::lane): each takes the lowest index free
/// and gives it back when its lease is dropped, so the indexes in use stay as few as the
/// acquisitions. A lane is the client's base (random, so that clients sharing one backend
/// spread over its connections) plus the index.
#[derive(Debug, Default)]
pub(crate) struct Lanes {
    base: u32,
    set: Mutex<LaneSet>,
}

#[derive(Debug, Default)]
struct LaneSet {
    /// Indexes below `end` that nobody holds.
    free: BTreeSet<u32>,
    /// One more than the highest index held.
    end: u32,
}

/// One acquisition's lane, given back when the last clone is dropped.
#[derive(Debug, Clone)]
pub(crate) struct LaneHold(Arc<HeldLane>);

#[derive(Debug)]
struct HeldLane {
    lanes: Arc<Lanes>,
    index: u32,
}

impl From<u32> for Lanes {
    /// Lanes from `base` on.
    fn from(base: u32) -> Self {
        Self {
            base,
            set: Mutex::default(),
        }
    }
}

impl Lanes {
    fn set(&self) -> std::sync::MutexGuard<'_, LaneSet> {
        self.set.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lowest lane free.
    pub(crate) fn take(self: &Arc<Self>) -> LaneHold {
        let mut set = self.set();
        let index = match set.free.pop_first() {
            Some(index) => index,
            None => {
                // 2^32 acquisitions at once cannot be: sharing a lane then is harmless.
                set.end = set.end.saturating_add(1);
                set.end - 1
            }
        };
        LaneHold(Arc::new(HeldLane {
            lanes: self.clone(),
            index,
        }))
    }
}

impl LaneHold {
    pub(crate) fn lane(&self) -> u32 {
        self.0.lanes.base.wrapping_add(self.0.index)
    }
}

impl Drop for HeldLane {
    fn drop(&mut self) {
        let mut guard = self.lanes.set();
        let set = &mut *guard;
        set.free.insert(self.index);
        // Free indexes at the top are forgotten: an idle client keeps no lane state.
        while set.end > 0 && set.free.remove(&(set.end - 1)) {
            set.end -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_the_lowest_free_and_leave_nothing_when_all_end() {
        // A base near the top: lanes wrap around.
        let lanes = Arc::new(Lanes::from(u32::MAX - 1));
        let a = lanes.take();
        let a_too = a.clone();
        let b = lanes.take();
        let c = lanes.take();
        assert_eq!((a.lane(), b.lane(), c.lane()), (u32::MAX - 1, u32::MAX, 0));
        drop(b);
        assert_eq!(
            lanes.take().lane(),
            u32::MAX,
            "the lowest free lane is reused"
        );
        drop(a);
        assert_eq!(
            lanes.take().lane(),
            u32::MAX,
            "a lane is held while a clone of its hold is"
        );
        drop(a_too);
        let again = lanes.take();
        assert_eq!(again.lane(), u32::MAX - 1);
        drop((again, c));
        let set = lanes.set();
        assert!(set.free.is_empty() && set.end == 0, "{set:?}");
    }
}
