//! The entry point: a backend, a clock and default options, and the handles built on them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::backend::{Backend, Capabilities, Eviction, LockState};
use crate::clock::{Clock, SystemClock};
use crate::context::Context;
use crate::error::Result;
use crate::events::EventSink;
use crate::name::{LockName, NamePrefix};
use crate::options::LockOptions;
use crate::sync::{Election, Job, MultiLock, Mutex, Part, RwLock, Semaphore, kept_record};
use crate::watching::LockWatch;

/// A connection to one lock backend, with the clock and default options its locks use.
/// Cheap to clone; clones share everything.
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
    ctx: Arc<Context>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("backend", &self.ctx.backend)
            .field("clock", &self.ctx.clock)
            .field("options", &self.ctx.options)
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
        Self::builder_from_arc(Arc::new(backend))
    }

    /// A builder for a backend already behind an `Arc`.
    pub fn builder_from_arc(backend: Arc<dyn Backend>) -> ClientBuilder {
        ClientBuilder {
            backend,
            clock: Arc::new(SystemClock),
            options: LockOptions::default(),
            events: None,
        }
    }

    /// An exclusive lock.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name (see
    /// [`LockName`]).
    pub fn mutex(&self, name: &str) -> Result<Mutex> {
        Ok(Mutex::new(self.ctx.clone(), LockName::new(name)?))
    }

    /// A scheduled job that runs at most once per [`Window`](crate::Window).
    /// Across every host (see [`Job`]), on the exclusive lock `name`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name.
    pub fn job(&self, name: &str) -> Result<Job> {
        Ok(Job::new(self.mutex(name)?))
    }

    /// A read-write lock: many readers or one writer.
    /// Waiting writers are not starved on backends with a queue.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name.
    pub fn rwlock(&self, name: &str) -> Result<RwLock> {
        Ok(RwLock::new(self.ctx.clone(), LockName::new(name)?))
    }

    /// Several locks taken all or none, in one canonical order (see [`MultiLock`]).
    /// The parts are mutexes ([`Part::from`]) and read-write lock sides ([`Part::read`],
    /// [`Part::write`]), of this client or others.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for no parts or a name
    /// twice.
    pub fn multi(&self, parts: impl IntoIterator<Item = Part>) -> Result<MultiLock> {
        MultiLock::new(parts)
    }

    /// A counting semaphore of `permits` permits, each an individual lease.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name or zero
    /// permits.
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore> {
        Semaphore::new(self.ctx.clone(), LockName::new(name)?, permits)
    }

    /// A leader election.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name.
    pub fn election(&self, name: &str) -> Result<Election> {
        Ok(Election::new(self.ctx.clone(), LockName::new(name)?))
    }

    /// Holders, waiters and tokens of a lock, as the server sees them.
    /// Where grants can be kept ([`Capabilities::can_keep`](crate::Capabilities::can_keep)),
    /// a second read marks a kept one ([`Holder::kept`](crate::backend::Holder::kept)).
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name; backend
    /// errors.
    pub async fn inspect(&self, name: &str) -> Result<LockState> {
        let name = LockName::new(name)?;
        let ctx = &self.ctx;
        let timeout = ctx.options.request_timeout();
        let mut state = ctx.call(timeout, ctx.backend.inspect(&name)).await?;
        // Which holder's grant is kept, where grants can be: only a label, so a failed
        // read leaves the holders unlabelled.
        if ctx.capabilities.can_keep() && !state.holders.is_empty() {
            let read = ctx.backend.get_record(&name, kept_record());
            if let Ok(Some(owner)) = ctx.call(timeout, read).await {
                for holder in &mut state.holders {
                    holder.kept = holder.owner.as_str().as_bytes() == owner;
                }
            }
        }
        Ok(state)
    }

    /// Every held or queued lock whose name begins with `prefix`.
    /// Each with its holders, tokens and waiters, sorted by name.
    ///
    /// The names need not be known: the backend is read a page of
    /// [`LIST_PAGE`](Client::LIST_PAGE) names at a time (`SCAN`, ranged reads, paged
    /// queries), so a large listing never blocks the server. It is not a snapshot: a lock
    /// taken or freed while the listing runs may or may not be in it.
    ///
    /// # Cancel safety
    ///
    /// Read-only; dropping the future changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad prefix;
    /// [`Error::Unsupported`](crate::Error::Unsupported) where the backend cannot list;
    /// backend errors.
    pub async fn locks(&self, prefix: &str) -> Result<Vec<(LockName, LockState)>> {
        let prefix = NamePrefix::new(prefix)?;
        let ctx = &self.ctx;
        let mut locks = BTreeMap::new();
        let mut cursor = None;
        loop {
            let page = ctx
                .call(
                    ctx.options.request_timeout(),
                    ctx.backend.list(&prefix, cursor.as_ref(), Self::LIST_PAGE),
                )
                .await?;
            // A name seen twice (a rehashing SCAN) keeps its later state.
            locks.extend(page.locks);
            match page.next {
                // A backend that hands back the cursor it was given would loop forever.
                Some(next) if cursor.as_ref() == Some(&next) => {
                    return Err(crate::Error::backend(
                        format!("the listing did not move past cursor {:?}", next.as_str()),
                        false,
                    ));
                }
                Some(next) => cursor = Some(next),
                None => return Ok(locks.into_iter().collect()),
            }
        }
    }

    /// Force-releases `name`: evicts its holders, recording who and why.
    /// Only `owner`'s grant if given; each eviction — `by` (`user@host`), `reason` — is
    /// recorded beside the name.
    ///
    /// Each evicted grant is that holder's grant only, checked by owner and token, never a
    /// newer one. The name stays closed until the evicted leases would have ended, so each
    /// evicted holder learns of its loss ([`LossReason::Evicted`](crate::LossReason) at its
    /// next renewal, or its deadline) before anyone else holds the lock; every later grant's
    /// token is greater than the evicted ones. Returns the evictions made (none if nobody
    /// held it). Waiters stay queued.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave some holders evicted and others not; each eviction is
    /// recorded with its grant's removal, atomically.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name, or a
    /// `reason` or `by` longer than [`EVICTION_TEXT_MAX`](Client::EVICTION_TEXT_MAX) or
    /// with control characters;
    /// [`Error::Unsupported`](crate::Error::Unsupported) where the backend cannot evict;
    /// backend errors.
    pub async fn evict(
        &self,
        name: &str,
        owner: Option<&crate::OwnerId>,
        by: &str,
        reason: &str,
    ) -> Result<Vec<Eviction>> {
        let lock = LockName::new(name)?;
        for (what, text) in [("eviction reason", reason), ("evicting operator", by)] {
            if text.len() > Self::EVICTION_TEXT_MAX || text.chars().any(char::is_control) {
                return Err(crate::Error::invalid(
                    what,
                    format!(
                        "at most {} bytes of text without control characters",
                        Self::EVICTION_TEXT_MAX
                    ),
                ));
            }
        }
        let ctx = &self.ctx;
        let timeout = ctx.options.request_timeout();
        let state = ctx.call(timeout, ctx.backend.inspect(&lock)).await?;
        let mut evicted = Vec::new();
        for holder in state.holders {
            if owner.is_some_and(|owner| *owner != holder.owner) {
                continue;
            }
            let eviction = Eviction::new(holder.owner, holder.token, by.into(), reason.into());
            let removed = ctx.backend.evict(&lock, holder.mode, &eviction);
            if ctx.call(timeout, removed).await? {
                evicted.push(eviction);
            }
        }
        Ok(evicted)
    }

    /// Follows every lock whose name begins with `prefix` as it changes hands.
    /// The watch is pushed by the backend's change feed ([`Backend::changes`]); see
    /// [`LockWatch::next`] for what it reports.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future, or the watch, ends the backend's feed.
    ///
    /// # Errors
    ///
    /// A bad prefix; [`Error::Unsupported`](crate::Error::Unsupported) for a backend
    /// without a change feed; backend errors.
    pub async fn watch(&self, prefix: &str) -> Result<LockWatch> {
        LockWatch::prefix(self.clone(), NamePrefix::new(prefix)?).await
    }

    /// Follows the locks called `names`, free or not, as they change hands.
    /// As [`watch`](Client::watch).
    ///
    /// # Cancel safety
    ///
    /// As [`watch`](Client::watch).
    ///
    /// # Errors
    ///
    /// As [`watch`](Client::watch), and a bad name.
    pub async fn watch_names(&self, names: &[&str]) -> Result<LockWatch> {
        let names = (names.iter())
            .map(|name| LockName::new(name))
            .collect::<Result<_>>()?;
        LockWatch::names(self.clone(), names).await
    }

    /// The longest `reason` or `by` [`evict`](Client::evict) records, in bytes.
    pub const EVICTION_TEXT_MAX: usize = 1024;

    /// How many names [`locks`](Client::locks) asks the backend to look at per request.
    pub const LIST_PAGE: usize = 1000;

    /// Waits until every background release has finished.
    /// Those are releases of dropped guards, releases whose futures were cancelled or not
    /// answered, and clean-ups of cancelled or timed-out acquisitions. On a backend whose
    /// grants live by a session, a release retried through a suspension of the session
    /// finishes when the link is back, or at the session's deadline at the latest.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops waiting; the releases go on.
    pub async fn settle(&self) {
        self.ctx.settle().await;
    }

    /// What the backend can do.
    pub fn capabilities(&self) -> &Capabilities {
        &self.ctx.capabilities
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.ctx.backend
    }

    /// The clock deadlines are measured on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.ctx.clock
    }

    /// The default options of locks made from this client.
    pub fn options(&self) -> &Arc<LockOptions> {
        &self.ctx.options
    }
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    options: LockOptions,
    events: Option<Arc<dyn EventSink>>,
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

    /// Sends every lock event of the client to `sink`.
    /// Those are grants, renewals, losses, releases and unknown outcomes (see [`events`](crate::events)). Without it none is made.
    pub fn events(mut self, sink: impl EventSink) -> Self {
        self.events = Some(Arc::new(sink));
        self
    }

    /// The client.
    pub fn build(self) -> Client {
        Client {
            ctx: Context::new(self.backend, self.clock, self.options, self.events),
        }
    }
}
