//! The engine's runtime context: what every acquisition, lease, renewal and release of one
//! client shares — the backend, the clock, the default options, the renewal schedule and
//! the background tasks that [`Client::settle`](crate::Client::settle) waits for.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::backend::{Backend, Capabilities};
use crate::clock::{Clock, Instant};
use crate::error::{Error, Result};
use crate::options::LockOptions;
use crate::watchdog::Watchdog;

/// One client's engine state. [`Client`](crate::Client) is a facade over it.
pub(crate) struct Context {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) capabilities: Capabilities,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) options: Arc<LockOptions>,
    /// The renewal schedule of this client's leases.
    pub(crate) watchdog: Arc<Watchdog>,
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
    ) -> Arc<Self> {
        Arc::new(Self {
            capabilities: backend.capabilities(),
            backend,
            watchdog: Arc::new(Watchdog::new(clock.clone())),
            clock,
            options: Arc::new(options),
            background: watch::Sender::new(0),
        })
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Runs `request` with a time limit; no answer in time is [`Error::Timeout`] (an
    /// unknown outcome).
    pub(crate) async fn call<T>(
        &self,
        limit: Duration,
        request: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(limit, request)
            .await
            .unwrap_or(Err(Error::Timeout(limit)))
    }

    /// Runs `task` in the background on `runtime`; [`settle`](Context::settle) waits for
    /// it.
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
