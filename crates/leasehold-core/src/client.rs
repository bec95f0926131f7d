//! The entry point: a backend, a clock and default options, and the handles built on them.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::backend::{Backend, Capabilities, LockState};
use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::options::LockOptions;
use crate::sync::{Election, Mutex, RwLock, Semaphore};
use crate::watchdog::Watchdog;

/// A connection to one lock backend, with the clock and default options every lock made
/// from it uses. Cheap to clone; clones share everything.
///
/// ```
/// use leasehold_core::{Client, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let orders = client.mutex("orders")?;
/// let guard = orders.lock().await?;
/// println!("holding {} with token {}", guard.name(), guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn Backend>,
    capabilities: Capabilities,
    clock: Arc<dyn Clock>,
    options: Arc<LockOptions>,
    background: watch::Sender<usize>,
    watchdog: Arc<Watchdog>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("backend", &self.inner.backend)
            .field("clock", &self.inner.clock)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl Client {
    /// A client on `backend` with the system clock and default options.
    pub fn new(backend: impl Backend) -> Self {
        Self::builder(backend).build()
    }

    /// A builder to choose the clock and the default options.
    pub fn builder(backend: impl Backend) -> ClientBuilder {
        ClientBuilder {
            backend: Arc::new(backend),
            clock: Arc::new(SystemClock),
            options: LockOptions::default(),
        }
    }

    /// A builder for a backend already behind an `Arc`.
    pub fn builder_from_arc(backend: Arc<dyn Backend>) -> ClientBuilder {
        ClientBuilder {
            backend,
            clock: Arc::new(SystemClock),
            options: LockOptions::default(),
        }
    }

    /// An exclusive lock.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name (see [`LockName`]).
    pub fn mutex(&self, name: &str) -> Result<Mutex> {
        Ok(Mutex::new(self.clone(), LockName::new(name)?))
    }

    /// A read-write lock: many readers or one writer; waiting writers are not starved on
    /// backends with a queue.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name.
    pub fn rwlock(&self, name: &str) -> Result<RwLock> {
        Ok(RwLock::new(self.clone(), LockName::new(name)?))
    }

    /// A counting semaphore of `permits` permits, each an individual lease.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name or zero permits.
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore> {
        Semaphore::new(self.clone(), LockName::new(name)?, permits)
    }

    /// A leader election.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name.
    pub fn election(&self, name: &str) -> Result<Election> {
        Ok(Election::new(self.clone(), LockName::new(name)?))
    }

    /// Holders, waiters and tokens of a lock, as the server sees them.
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name; backend errors.
    pub async fn inspect(&self, name: &str) -> Result<LockState> {
        let name = LockName::new(name)?;
        self.call(
            self.inner.options.request_timeout(),
            self.inner.backend.inspect(&name),
        )
        .await
    }

    /// Waits until every background release has finished: releases scheduled by dropped
    /// guards and clean-ups of cancelled or timed-out acquisitions.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops waiting; the releases go on.
    pub async fn settle(&self) {
        let mut rx = self.inner.background.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = rx.wait_for(|pending| *pending == 0).await;
    }

    /// What the backend can do.
    pub fn capabilities(&self) -> &Capabilities {
        &self.inner.capabilities
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The clock deadlines are measured on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.clock
    }

    /// The default options of locks made from this client.
    pub fn options(&self) -> &Arc<LockOptions> {
        &self.inner.options
    }

    /// The renewal schedule of this client's leases.
    pub(crate) fn watchdog(&self) -> &Arc<Watchdog> {
        &self.inner.watchdog
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

    /// Runs `task` in the background on `runtime`; [`settle`](Client::settle) waits for it.
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
        self.inner.background.send_modify(|n| *n += 1);
        let pending = Pending(self.inner.background.clone());
        // If the runtime is shutting down the task is dropped unrun, and `pending` with it.
        runtime.spawn(async move {
            let _pending = pending;
            task.await;
        });
    }
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    options: LockOptions,
}

impl ClientBuilder {
    /// The clock for lease deadlines (default: [`SystemClock`]).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Default options for every lock made from the client (already validated).
    pub fn options(mut self, options: LockOptions) -> Self {
        self.options = options;
        self
    }

    /// The client.
    pub fn build(self) -> Client {
        Client {
            inner: Arc::new(Inner {
                capabilities: self.backend.capabilities(),
                backend: self.backend,
                clock: self.clock,
                options: Arc::new(self.options),
                background: watch::Sender::new(0),
                watchdog: Arc::default(),
            }),
        }
    }
}
