//! Scheduled jobs: run at most once per window across every host.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::future::Future;

use super::{Guard, Mutex};
use crate::clock::Instant;
use crate::error::{Error, LossReason, Result};
use crate::fencing::FencingToken;
use crate::name::{LockName, OwnerId, RecordKey};
use crate::options::LockOptions;

/// How long a named window's record is kept when nothing else is said: a week.
const NAMED_WINDOW_KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// Which fire of a scheduled job a run counts for.
///
/// Either a window of a fixed period aligned on the Unix epoch (`1h`: every hour on the
/// hour, UTC), found from the host's wall clock, or a window the caller names (a cron fire's
/// timestamp). A job runs at most once per window: the run that finishes it leaves a
/// completion record beside the lock, which closes the window for every later claim.
#[derive(Clone, PartialEq, Eq)]
pub struct Window {
    id: String,
    key: RecordKey,
    start: Option<SystemTime>,
    keep: Duration,
}

impl Window {
    /// The window of `period` that the wall-clock reading `now` counts for.
    ///
    /// Hosts' clocks disagree: a reading up to `skew` before a window's start counts for
    /// that window, so that every host whose clock is within `skew` of the others and fires
    /// at (or after) a window's start by its own clock names the same window. The record is
    /// kept for two periods and a minute.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `period` is at least 1 ms, in whole milliseconds,
    /// and `skew` is under half of it.
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use leasehold_core::Window;
    ///
    /// let hour = Duration::from_secs(3600);
    /// let skew = Duration::from_secs(30);
    /// // 11:59:45 by a clock that runs a little behind: the noon window.
    /// let early = UNIX_EPOCH + Duration::from_secs(12 * 3600 - 15);
    /// let noon = UNIX_EPOCH + Duration::from_secs(12 * 3600);
    /// assert_eq!(Window::aligned(hour, skew, early)?.start(), Some(noon));
    /// assert_eq!(Window::aligned(hour, skew, noon + hour / 2)?.start(), Some(noon));
    /// # Ok::<(), leasehold_core::Error>(())
    /// ```
    pub fn aligned(period: Duration, skew: Duration, now: SystemTime) -> Result<Self> {
        let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        if period_ms == 0 || Duration::from_millis(period_ms) != period {
            return Err(Error::invalid(
                "period",
                format!("{period:?}: give a period of at least 1ms, in whole milliseconds"),
            ));
        }
        if skew >= period / 2 {
            return Err(Error::invalid(
                "skew",
                format!(
                    "{skew:?} is not under half the period ({period:?}): hosts whose clocks \
                     are that far apart could not agree on a window"
                ),
            ));
        }
        let since_epoch = now
            .duration_since(UNIX_EPOCH)
            .map_err(|_| Error::invalid("clock", "the wall clock reads before 1970"))?;
        let reading = u64::try_from((since_epoch + skew).as_millis()).unwrap_or(u64::MAX);
        let start_ms = reading - reading % period_ms;
        let id = format!("{start_ms}+{period_ms}");
        Ok(Self {
            key: RecordKey::new(&format!("window:{id}"))?,
            id,
            start: Some(UNIX_EPOCH + Duration::from_millis(start_ms)),
            keep: period
                .saturating_mul(2)
                .saturating_add(Duration::from_secs(60)),
        })
    }

    /// The window the caller names `id` (a cron fire's timestamp, a batch's date).
    /// Its record is kept for a week (see [`keep`](Window::keep)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless `id` is 1 to 93 characters valid in a lock name.
    pub fn named(id: &str) -> Result<Self> {
        if id.is_empty() {
            return Err(Error::invalid("window id", "the id is empty"));
        }
        let key = RecordKey::new(&format!("window:{id}")).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::invalid("window id", reason),
            other => other,
        })?;
        Ok(Self {
            id: id.to_owned(),
            key,
            start: None,
            keep: NAMED_WINDOW_KEEP,
        })
    }

    /// This window, its record kept at least `keep` by the server.
    pub fn keep(mut self, keep: Duration) -> Self {
        self.keep = keep;
        self
    }

    /// The window's id: `<start ms>+<period ms>` for an aligned one, or the given name.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// When an aligned window starts; `None` for a named one.
    pub fn start(&self) -> Option<SystemTime> {
        self.start
    }
}

impl fmt::Debug for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Window").field(&self.id).finish()
    }
}

/// How a job's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It succeeded.
    Succeeded,
    /// It failed, with its exit code where it had one.
    Failed(Option<i32>),
}

/// The record a finished run leaves beside the lock.
/// Who ran the job in a window, and how it went.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completion {
    /// The window's id.
    pub window: String,
    /// The run's owner id.
    pub owner: OwnerId,
    /// The run's fencing token.
    pub token: FencingToken,
    /// Who ran it (`user@host`, as the caller says).
    pub by: String,
    /// When it started, by the runner's wall clock.
    pub started: SystemTime,
    /// When it ended, by the runner's wall clock.
    pub ended: SystemTime,
    /// How it ended.
    pub outcome: Outcome,
}

impl Completion {
    fn encode(&self) -> String {
        let ms = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        let outcome = match self.outcome {
            Outcome::Succeeded => "ok".to_owned(),
            Outcome::Failed(Some(code)) => format!("failed:{code}"),
            Outcome::Failed(None) => "failed".to_owned(),
        };
        format!(
            "window={}\nowner={}\ntoken={}\nby={}\nstarted_ms={}\nended_ms={}\noutcome={outcome}\n",
            self.window,
            self.owner,
            self.token,
            self.by,
            ms(self.started),
            ms(self.ended),
        )
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |what: &str| {
            let message = format!("a completion record's {what} is missing or garbled");
            Error::backend(message, false)
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad("the text"))?;
        let field = |key: &str| {
            (text.lines())
                .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
                .ok_or_else(|| bad(key))
        };
        let time = |key: &str| -> Result<SystemTime> {
            let ms: u64 = field(key)?.parse().map_err(|_| bad(key))?;
            Ok(UNIX_EPOCH + Duration::from_millis(ms))
        };
        let outcome = match field("outcome")? {
            "ok" => Outcome::Succeeded,
            "failed" => Outcome::Failed(None),
            other => {
                let code = other
                    .strip_prefix("failed:")
                    .ok_or_else(|| bad("outcome"))?;
                Outcome::Failed(Some(code.parse().map_err(|_| bad("outcome"))?))
            }
        };
        let token: u64 = field("token")?.parse().map_err(|_| bad("token"))?;
        Ok(Self {
            window: field("window")?.to_owned(),
            owner: OwnerId::parse(field("owner")?)?,
            token: FencingToken::new(token),
            by: field("by")?.to_owned(),
            started: time("started_ms")?,
            ended: time("ended_ms")?,
            outcome,
        })
    }
}

/// What [`Job::claim`] found.
#[derive(Debug)]
pub enum Claim {
    /// The window is open and the lock is held.
    /// Run the job, then [`finish`](JobRun::finish).
    Run(JobRun),
    /// The window is closed: a run finished in it.
    /// One that failed closes it too, unless the job retries failed runs.
    Done(Completion),
    /// Someone else holds the lock: the job is running elsewhere. Only when not waiting.
    Busy,
}

/// A job that runs at most once per [`Window`] across every host, on one lock.
///
/// Each run takes the lock, reads the window's completion record and runs only if there is
/// none; it finishes by writing the record *fenced by its grant* — the server writes it only
/// while that grant holds — and releasing. So a run whose lock was lost midway (paused,
/// partitioned, evicted) cannot close the window: the next holder finds it open and runs,
/// with a higher fencing token.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use leasehold_core::{Claim, Client, Outcome, Window, memory::InMemory};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// let client = Client::new(InMemory::new());
/// let job = client.job("reports:daily")?;
/// let window = Window::named("2026-11-27")?;
/// let Claim::Run(run) = job.try_claim(&window).await? else { unreachable!() };
/// // ... the job's work, fenced with run.guard().token() ...
/// run.finish(Outcome::Succeeded).await?;
/// assert!(matches!(job.try_claim(&window).await?, Claim::Done(_)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Job {
    mutex: Mutex,
    retry_failed: bool,
    by: String,
}

impl Job {
    pub(crate) fn new(mutex: Mutex) -> Self {
        Self {
            mutex,
            retry_failed: false,
            by: String::new(),
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.mutex.name()
    }

    /// This job, locking with `options`.
    /// Pass an `Arc` to share one copy among many handles (many held locks).
    pub fn with_options(mut self, options: impl Into<std::sync::Arc<LockOptions>>) -> Self {
        self.mutex = self.mutex.with_options(options);
        self
    }

    /// This job, running again in a window whose run failed (closed otherwise).
    pub fn retry_failed(mut self, retry: bool) -> Self {
        self.retry_failed = retry;
        self
    }

    /// This job, its completion records saying it was run `by` this (`user@host`).
    pub fn run_by(mut self, by: impl Into<String>) -> Self {
        self.by = by.into();
        self
    }

    /// Claims `window` without waiting for the lock.
    ///
    /// # Cancel safety
    ///
    /// As for [`Mutex::try_lock`]: dropped, it leaves nothing held.
    ///
    /// # Errors
    ///
    /// As for [`Mutex::try_lock`], and [`Error::Unsupported`] where the backend keeps no
    /// records.
    pub async fn try_claim(&self, window: &Window) -> Result<Claim> {
        self.claim_with(window, self.mutex.try_lock()).await
    }

    /// Claims `window`, waiting for the lock as long as it takes.
    /// A run elsewhere is waited for: it then closes the window (or leaves it open, having
    /// failed or lost its lock), and the answer says which.
    ///
    /// # Cancel safety
    ///
    /// As for [`Mutex::lock`].
    ///
    /// # Errors
    ///
    /// As for [`try_claim`](Job::try_claim).
    pub async fn claim(&self, window: &Window) -> Result<Claim> {
        self.claim_with(window, async { self.mutex.lock().await.map(Some) })
            .await
    }

    /// Claims `window`, waiting for the lock at most `timeout` ([`Claim::Busy`] then).
    ///
    /// # Cancel safety
    ///
    /// As for [`Mutex::lock_timeout`].
    ///
    /// # Errors
    ///
    /// As for [`try_claim`](Job::try_claim).
    pub async fn claim_timeout(&self, window: &Window, timeout: Duration) -> Result<Claim> {
        self.claim_with(window, self.mutex.lock_timeout(timeout))
            .await
    }

    /// The window's completion, if it closes the window.
    /// (With [`retry_failed`](Job::retry_failed), a failed run's does not.)
    ///
    /// # Cancel safety
    ///
    /// It only reads: dropping it changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after the request timeout; [`Error::Backend`] for a record that
    /// is not a completion; [`Error::Unsupported`] where the backend keeps no records;
    /// backend errors.
    pub async fn completion(&self, window: &Window) -> Result<Option<Completion>> {
        let ctx = &self.mutex.target.ctx;
        let read = ctx.backend.get_record(self.name(), &window.key);
        let timeout = self.mutex.options().request_timeout();
        let Some(bytes) = ctx.call(timeout, read).await? else {
            return Ok(None);
        };
        let done = Completion::decode(&bytes)?;
        let retried = self.retry_failed && matches!(done.outcome, Outcome::Failed(_));
        Ok((!retried).then_some(done))
    }

    async fn claim_with(
        &self,
        window: &Window,
        lock: impl Future<Output = Result<Option<Guard>>>,
    ) -> Result<Claim> {
        // A closed window needs no lock.
        if let Some(done) = self.completion(window).await? {
            return Ok(Claim::Done(done));
        }
        let Some(guard) = lock.await? else {
            return Ok(Claim::Busy);
        };
        // Read again under the lock: the run before may have finished meanwhile. Its
        // record was written before its release, so this grant sees it.
        let started = SystemTime::now();
        let began = self.mutex.target.ctx.clock.now();
        match self.completion(window).await {
            Ok(None) => Ok(Claim::Run(JobRun {
                ticket: JobTicket {
                    window: window.clone(),
                    by: self.by.clone(),
                    owner: guard.owner().clone(),
                    started,
                    began,
                },
                guard,
            })),
            Ok(Some(done)) => {
                // The window is closed whatever the release says; a failed one goes on
                // in the background.
                if let Err(error) = guard.release().await {
                    tracing::warn!(lock = %self.name(), %error, "releasing after a closed window");
                }
                Ok(Claim::Done(done))
            }
            Err(error) => {
                drop(guard);
                Err(error)
            }
        }
    }
}

/// A claimed run of a [`Job`] in one window: the lock is held until it finishes.
/// Dropped unfinished, it releases the lock and leaves the window open.
#[derive(Debug)]
pub struct JobRun {
    guard: Guard,
    ticket: JobTicket,
}

impl JobRun {
    /// The run's guard: its token fences the job's writes, its loss ends the run.
    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// The window this run counts for.
    pub fn window(&self) -> &Window {
        &self.ticket.window
    }

    /// Splits the run into its guard and what finishing it takes.
    /// For a caller that hands the guard to code that owns it for the run (a
    /// [`MultiGuard`](crate::MultiGuard)) and gets it back at the end.
    pub fn into_parts(self) -> (Guard, JobTicket) {
        (self.guard, self.ticket)
    }

    /// Writes the window's completion record, fenced by the grant, and releases the lock.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] if the grant was lost before the record could be written: the
    /// window stays open for the next holder (which runs with a higher token); backend
    /// errors (whether the record was written is then unknown; the lock is released).
    pub async fn finish(self, outcome: Outcome) -> Result<Completion> {
        self.ticket
            .finish(self.guard, outcome, Duration::ZERO)
            .await
    }
}

/// What finishing a [`JobRun`] takes besides its guard (see [`JobRun::into_parts`]).
#[derive(Debug)]
pub struct JobTicket {
    window: Window,
    by: String,
    owner: OwnerId,
    /// When the run began, by the wall clock (for the record) and the client's clock.
    started: SystemTime,
    began: Instant,
}

impl JobTicket {
    /// The window this run counts for.
    pub fn window(&self) -> &Window {
        &self.window
    }

    /// Finishes the run `guard` is the guard of, as [`JobRun::finish`] does.
    /// Then, rather than releasing, it leaves the lock held until `at_least` after the run
    /// began (see [`Guard::keep_for`]); if that has passed, or `at_least` is zero, it
    /// releases.
    ///
    /// # Errors
    ///
    /// As for [`JobRun::finish`], and [`Error::InvalidArgument`] if `guard` is not this
    /// run's. Once the record is written the answer is `Ok`: a lock that cannot be kept
    /// ([`Capabilities::can_keep`](crate::Capabilities::can_keep)) is released, and a
    /// release that fails goes on in the background (both logged).
    pub async fn finish(
        self,
        guard: Guard,
        outcome: Outcome,
        at_least: Duration,
    ) -> Result<Completion> {
        if *guard.owner() != self.owner {
            return Err(Error::invalid("guard", "not the guard of this job's run"));
        }
        let done = Completion {
            window: self.window.id.clone(),
            owner: self.owner,
            token: guard.token(),
            by: self.by,
            started: whole_ms(self.started),
            ended: whole_ms(SystemTime::now()),
            outcome,
        };
        let record = done.encode();
        // Writing the same record again is harmless; but once an attempt's outcome is
        // unknown, a later "not held" cannot say the record was not written.
        let mut unconfirmed = None;
        let written = loop {
            let write = guard.put_record(&self.window.key, record.as_bytes(), self.window.keep);
            match (write.await, unconfirmed.is_some()) {
                (Err(error @ (Error::Timeout(_) | Error::Unavailable { .. })), _) => {
                    if unconfirmed.replace(error).is_some() {
                        break Err(unconfirmed.take().unwrap_or(Error::Timeout(Duration::ZERO)));
                    }
                }
                (Ok(false), true) => {
                    break Err(Error::backend(
                        "the completion record's write timed out and the grant is gone since: \
                         whether the window is closed is unknown",
                        false,
                    ));
                }
                (written, _) => break written,
            }
        };
        match written {
            Ok(true) => {}
            Ok(false) => {
                drop(guard);
                return Err(Error::Lost(LossReason::NotOwner));
            }
            Err(error) => {
                drop(guard);
                return Err(error);
            }
        }
        // The window is closed: what happens to the lock now does not change that.
        let clock = &guard.lease().ctx.clock;
        let held = clock.now().saturating_duration_since(self.began);
        if let Err(error) = guard.keep_for(at_least.saturating_sub(held)).await {
            tracing::warn!(window = %done.window, %error, "letting go of a finished job's lock");
        }
        Ok(done)
    }
}

/// `t` in whole milliseconds, as a record keeps it.
fn whole_ms(t: SystemTime) -> SystemTime {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    UNIX_EPOCH + Duration::from_millis(u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}
