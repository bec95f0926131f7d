//! leasehold's local embedded backend: cross-process locks on one host through file locks.
//!
//! The crate, one concern per file:
//!
//! - `lib.rs`: this map, [`FileBackend`] and its lock files, tokens and records.
//! - `ofd.rs`: byte-range write locks owned by an open file description (the permits).
//! - `registry.rs`: per-name state that lives exactly as long as someone holds a handle.
//! - `notify.rs`: push wake-ups for waiters: one inotify watch on the lock directory.
//!
//! The kernel releases a file lock when the process holding it dies, however it dies, so
//! grants here never expire and need no renewal: a holder keeps its lock until it releases
//! it or exits. That makes this backend a good default for one machine (cron jobs, CLI
//! tools, tests) and a poor one for anything that spans machines: use a server backend for
//! that (and note that NFS file locking is not reliable enough to build on).
//!
//! # Files
//!
//! For a lock name `N`, the lock directory holds, while the name is in use:
//!
//! | file | purpose |
//! |---|---|
//! | `N#lock` | `flock` exclusive (mutex, writer, leader) or shared (reader) |
//! | `N#gate` | writer preference: a waiting writer holds it, new readers queue behind |
//! | `N#sem` | semaphore: permit `K` is a write lock on byte `K` (Linux open-file-description locks) |
//! | `N#who-OWNER` | holder / waiter record for `inspect` (pid, mode, token, value) |
//!
//! and for all names together `#tokens`, the fencing counters: 1024 counters of 8 bytes, a
//! name's counter chosen by a hash of the name, each bumped under its own byte-range lock and
//! fsynced. `#` never occurs in a lock name, so no name's files collide with another's.
//!
//! A lock file is deleted by its last holder while it still holds it, and whoever locks a
//! lock file checks afterwards that it is still the file under that name (and otherwise
//! takes the new one), so a deleted file can never be held beside its successor. So the
//! directory holds files only for names in use, plus the counters. Do not delete lock files
//! by hand while locks are in use; that check only covers deletions by this backend.
//!
//! # Descriptors
//!
//! An exclusive or shared acquisition keeps one descriptor (a waiting writer two); all
//! permits and permit waiters of one name in one [`FileBackend`] share one descriptor of
//! `N#sem`, however many permits the semaphore has.
//!
//! # Guarantees
//!
//! - Mutual exclusion between all processes (and all clients in one process) using the same
//!   directory on one host, for as long as nobody deletes the lock files by hand.
//! - A holder that dies releases at once: no TTL to wait out.
//! - Fencing tokens strictly increase per name for as long as the `#tokens` file survives:
//!   across process restarts always; across reboots only if the directory is on persistent
//!   storage (the default directory under `$XDG_RUNTIME_DIR` is usually a tmpfs, reset at
//!   boot — point `file:///var/lib/...` at persistent storage if a protected resource
//!   outlives reboots).
//! - Waiters are woken by inotify when a holder releases or dies; no polling on Linux.
//! - No FIFO queue: waiters race for a released lock. Readers do queue behind a waiting
//!   writer, so writers are not starved.

mod notify;
#[cfg(target_os = "linux")]
mod ofd;
mod registry;

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Mode, Release, Renewal,
    Request, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::support::wakeups::Ticket;
use leasehold_core::{Error, FencingToken, LockName, LossReason, OwnerId, Result};
use rustix::fs::{FlockOperation, flock};

use crate::notify::Notifier;
use crate::registry::{Entry, Registry};

/// The file of the fencing counters.
const TOKENS: &str = "#tokens";
/// How many counters it holds.
const TOKEN_SHARDS: u64 = 1024;

/// The file-lock backend.
/// Clones share their state; separate instances (in one process or many) on the same
/// directory exclude each other through the kernel.
///
/// ```
/// use leasehold_core::Client;
/// use leasehold_file::FileBackend;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// let client = Client::new(FileBackend::open(dir.path())?);
/// let guard = client.mutex("backup")?.lock().await?;
/// println!("token {}", guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct FileBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    notifier: Notifier,
    /// This instance's semaphores in use, by name.
    semaphores: Registry<Semaphore>,
}

/// What this process holds and waits for, by owner id (unique per acquisition).
/// That is across all instances: a record naming this process is live exactly while its
/// owner is in here.
static STATE: LazyLock<Mutex<State>> = LazyLock::new(Mutex::default);

#[derive(Debug, Default)]
struct State {
    held: HashMap<OwnerId, Held>,
    waiting: HashMap<OwnerId, Files>,
}

#[derive(Debug)]
struct Held {
    name: LockName,
    token: FencingToken,
    /// Dropping these releases the kernel locks.
    files: Files,
}

/// Descriptors of one acquisition.
/// A waiter keeps them between tries, so that its tries do not close (and signal) anything.
#[derive(Debug, Default)]
struct Files {
    name: Option<LockName>,
    lock: Option<LockFile>,
    gate: Option<LockFile>,
    permit: Option<PermitHold>,
    recorded: bool,
}

/// One acquisition's descriptor of `N#lock` or `N#gate`.
/// Dropping it releases the lock; a sole holder deletes the file first.
#[derive(Debug)]
struct LockFile {
    path: PathBuf,
    file: File,
    /// `Some(exclusive)` while this descriptor holds the `flock`.
    held: Option<bool>,
}

impl LockFile {
    /// Opens (creating) for writing, so that closing it — or the holder's death — signals waiters.
    fn open(path: PathBuf) -> Result<Self> {
        let file = open_rw(&path)?;
        Ok(Self {
            path,
            file,
            held: None,
        })
    }

    /// Takes the `flock` without waiting: `Ok(false)` if someone else holds it.
    /// A file that was deleted since it was opened is replaced by the current one first.
    fn try_lock(&mut self, exclusive: bool) -> Result<bool> {
        let op = if exclusive {
            FlockOperation::NonBlockingLockExclusive
        } else {
            FlockOperation::NonBlockingLockShared
        };
        loop {
            let locked = try_flock(&self.file, op)?;
            if is_linked(&self.file, &self.path)? {
                if locked {
                    self.held = Some(exclusive);
                }
                return Ok(locked);
            }
            // Its last holder deleted it; a lock on it would exclude nobody.
            self.file = open_rw(&self.path)?;
        }
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // Delete the file if this is its only holder, while holding it exclusively: anyone
        // who opened it before sees that it is gone once they lock it.
        let sole = match self.held {
            Some(true) => true,
            // Not atomic: on failure the shared lock is gone too, which is what we want.
            Some(false) => {
                try_flock(&self.file, FlockOperation::NonBlockingLockExclusive).unwrap_or(false)
            }
            None => false,
        };
        if sole && is_linked(&self.file, &self.path).unwrap_or(false) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A permit taken or wanted through this instance's semaphore of a name.
#[derive(Debug)]
struct PermitHold {
    semaphore: Arc<Entry<Semaphore>>,
    slot: Option<u64>,
}

impl Drop for PermitHold {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.semaphore.release(slot);
        }
    }
}

/// This instance's side of one semaphore name.
/// It is one descriptor of `N#sem` shared by all its permits and permit waiters
/// (open-file-description locks of one description never conflict, so the permits it holds
/// are kept apart in `held`).
#[derive(Debug)]
struct Semaphore {
    path: PathBuf,
    state: Mutex<SemaphoreState>,
}

#[derive(Debug, Default)]
struct SemaphoreState {
    file: Option<File>,
    held: Slots,
}

impl Semaphore {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SemaphoreState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the lowest free permit below `limit`, if any.
    /// Each step skips a whole run of taken permits (this instance's, or one other
    /// description's), so a try costs about as many system calls as there are runs below
    /// the first free permit, not `limit`.
    #[cfg(target_os = "linux")]
    fn try_acquire(&self, limit: u64) -> Result<Option<u64>> {
        use crate::ofd::{self, Range};
        let failed = |e| io_error(&format!("locking {}", self.path.display()), e);
        let mut guard = self.state();
        let SemaphoreState { file: open, held } = &mut *guard;
        loop {
            let file = reuse(open, || open_rw(&self.path))?;
            let mut slot = 0;
            let found = loop {
                if slot >= limit {
                    break None;
                }
                if let Some(end) = held.run_end(slot) {
                    slot = end;
                    continue;
                }
                if ofd::try_lock(&*file, Range::new(slot, 1)).map_err(failed)? {
                    break Some(slot);
                }
                // Skip the run of the description in the way (freed meanwhile: try again).
                if let Some(blocker) = ofd::blocker(&*file, Range::new(slot, 1)).map_err(failed)? {
                    slot = blocker.end().max(slot + 1);
                }
            };
            let Some(slot) = found else {
                return Ok(None);
            };
            if is_linked(file, &self.path)? {
                held.insert(slot);
                return Ok(Some(slot));
            }
            // Deleted by its last user since we opened it, which happens only when no
            // permit is held on it: take the current file.
            if !held.is_empty() {
                return Err(Error::backend(
                    format!(
                        "{} was deleted while permits were held on it",
                        self.path.display()
                    ),
                    false,
                ));
            }
            *open = None;
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn try_acquire(&self, _limit: u64) -> Result<Option<u64>> {
        Err(Error::Unsupported {
            backend: "file",
            feature: "permits (they need Linux open-file-description locks)",
        })
    }

    /// Gives back one permit and tells waiters.
    /// A byte-range unlock raises no file event, so the file is touched.
    fn release(&self, slot: u64) {
        let mut state = self.state();
        #[cfg(target_os = "linux")]
        if let Some(file) = &state.file {
            let _ = ofd::unlock(file, ofd::Range::new(slot, 1));
            let now = rustix::fs::Timespec {
                tv_sec: 0,
                tv_nsec: rustix::fs::UTIME_NOW,
            };
            let _ = rustix::fs::futimens(
                file,
                &rustix::fs::Timestamps {
                    last_access: now,
                    last_modification: now,
                },
            );
        }
        state.held.remove(slot);
    }

    /// A descriptor of the description holding this instance's permits.
    fn descriptor(&self) -> Option<std::io::Result<OwnedFd>> {
        self.state()
            .file
            .as_ref()
            .map(|f| f.try_clone().map(OwnedFd::from))
    }
}

impl Drop for Semaphore {
    fn drop(&mut self) {
        // The last permit and waiter of this instance are gone: delete the file if nobody
        // holds a permit on it, holding all of it meanwhile.
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        #[cfg(target_os = "linux")]
        if let Some(file) = state.file.take()
            && state.held.is_empty()
            && ofd::try_lock(&file, ofd::Range::new(0, 0)).unwrap_or(false)
            && is_linked(&file, &self.path).unwrap_or(false)
        {
            let _ = std::fs::remove_file(&self.path);
        }
        state.file = None;
    }
}

/// Slot numbers held, as disjoint, non-adjacent runs `start..end`.
#[derive(Debug, Default)]
struct Slots(BTreeMap<u64, u64>);

impl Slots {
    /// The end of the run holding `slot`, if one does.
    fn run_end(&self, slot: u64) -> Option<u64> {
        let (_, &end) = self.0.range(..=slot).next_back()?;
        (end > slot).then_some(end)
    }

    /// Adds a slot not held yet.
    fn insert(&mut self, slot: u64) {
        let (mut start, mut end) = (slot, slot + 1);
        if let Some((&before, &before_end)) = self.0.range(..slot).next_back()
            && before_end == slot
        {
            start = before;
        }
        if let Some(after_end) = self.0.remove(&end) {
            end = after_end;
        }
        self.0.insert(start, end);
    }

    fn remove(&mut self, slot: u64) {
        let Some((&start, &end)) = self.0.range(..=slot).next_back() else {
            return;
        };
        if end <= slot {
            return;
        }
        self.0.remove(&start);
        if start < slot {
            self.0.insert(start, slot);
        }
        if slot + 1 < end {
            self.0.insert(slot + 1, end);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A duplicate of the descriptor through which this process holds the grant of `owner`.
/// The duplicate is close-on-exec; `None` if the process holds none.
///
/// A process that inherits it (clear close-on-exec on a copy, then start the process) keeps
/// the kernel lock while it lives, even after this process has died; so `leasehold run`
/// makes sure that a lock outlives its holder only as long as the command it runs.
/// Releasing the grant ends it all the same (for a permit the descriptor is the one shared
/// by every permit of that name in the same [`FileBackend`]).
pub fn held_descriptor(owner: &OwnerId) -> Option<std::io::Result<OwnedFd>> {
    let state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let files = &state.held.get(owner)?.files;
    if let Some(lock) = &files.lock {
        return Some(lock.file.try_clone().map(OwnedFd::from));
    }
    files.permit.as_ref()?.semaphore.descriptor()
}

impl FileBackend {
    /// A backend on the lock directory `dir`, created (mode 0700) if missing.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the directory cannot be created or is not a directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io_error(&format!("creating lock directory {}", dir.display()), e))?;
        if !dir.is_dir() {
            return Err(Error::unavailable(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        let notifier =
            Notifier::new(&dir).map_err(|e| io_error(&format!("watching {}", dir.display()), e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                notifier,
                semaphores: Registry::new(),
            }),
        })
    }

    /// A backend on [`default_dir`].
    ///
    /// # Errors
    ///
    /// As for [`open`](FileBackend::open).
    pub fn open_default() -> Result<Self> {
        Self::open(default_dir())
    }

    /// The lock directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    fn path(&self, name: &LockName, kind: &str) -> PathBuf {
        self.inner.dir.join(format!("{name}#{kind}"))
    }

    fn state(&self) -> std::sync::MutexGuard<'static, State> {
        STATE.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tries the kernel locks for `req`, reusing and keeping `files`. `Ok(true)`: granted.
    fn try_lock(&self, req: &Request, files: &mut Files) -> Result<bool> {
        let name = &req.name;
        match req.mode {
            Mode::Exclusive => {
                if req.waiting {
                    // Announce a waiting writer: new readers queue behind it.
                    let gate = reuse(&mut files.gate, || LockFile::open(self.path(name, "gate")))?;
                    if gate.held.is_none() && !gate.try_lock(true)? {
                        return Ok(false);
                    }
                }
                let lock = reuse(&mut files.lock, || LockFile::open(self.path(name, "lock")))?;
                let granted = lock.try_lock(true)?;
                if granted {
                    files.gate = None;
                }
                Ok(granted)
            }
            Mode::Shared => {
                // Read-only and never created here, so that taking and dropping the gate
                // signals nothing.
                match File::open(self.path(name, "gate")) {
                    Ok(gate) => {
                        if !try_flock(&gate, FlockOperation::NonBlockingLockShared)? {
                            return Ok(false);
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(io_error(&format!("opening {name}#gate"), e)),
                }
                let lock = reuse(&mut files.lock, || LockFile::open(self.path(name, "lock")))?;
                lock.try_lock(false)
            }
            Mode::Permit { limit } => {
                let permit = reuse(&mut files.permit, || {
                    Ok(PermitHold {
                        semaphore: self.inner.semaphores.get_or_insert_with(name.as_str(), || {
                            Semaphore::new(self.path(name, "sem"))
                        }),
                        slot: None,
                    })
                })?;
                permit.slot = permit.semaphore.try_acquire(u64::from(limit.get()))?;
                Ok(permit.slot.is_some())
            }
        }
    }

    /// Bumps and returns the fencing counter of `name`.
    async fn next_token(&self, name: &LockName) -> Result<FencingToken> {
        let file = self.tokens()?;
        let offset = fnv1a(name.as_str().as_bytes()) % TOKEN_SHARDS * 8;
        // Another process holds the counter only for a read and a write; wait for it
        // without blocking the runtime.
        let mut pause = Duration::from_micros(100);
        while !lock_counter(&file, offset)? {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
        let counter_error = |e| io_error(&format!("updating the fencing counter of {name}"), e);
        let mut bytes = [0; 8];
        file.read_exact_at(&mut bytes, offset)
            .map_err(counter_error)?;
        let next = u64::from_le_bytes(bytes).checked_add(1).ok_or_else(|| {
            Error::backend(format!("the fencing counter of {name} is exhausted"), false)
        })?;
        file.write_all_at(&next.to_le_bytes(), offset)
            .map_err(counter_error)?;
        file.sync_data().map_err(counter_error)?;
        // Closing the file releases the counter.
        Ok(FencingToken::new(next))
    }

    /// Opens the counters, creating them if missing.
    fn tokens(&self) -> Result<File> {
        let path = self.inner.dir.join(TOKENS);
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                self.create_tokens()?;
                OpenOptions::new().read(true).write(true).open(&path)
            }
            other => other,
        }
        .map_err(|e| io_error(&format!("opening {}", path.display()), e))?;
        let len = file
            .metadata()
            .map_err(|e| io_error(&format!("reading {}", path.display()), e))?
            .len();
        if len != TOKEN_SHARDS * 8 {
            return Err(Error::backend(
                format!(
                    "{} holds {len} bytes, not {} counters; refusing to guess a token",
                    path.display(),
                    TOKEN_SHARDS
                ),
                false,
            ));
        }
        Ok(file)
    }

    /// Creates `#tokens` whole (written aside, then linked into place).
    /// Every counter starts above the highest per-name counter (`N#token`) of earlier
    /// versions, which are then removed.
    fn create_tokens(&self) -> Result<()> {
        let dir = &self.inner.dir;
        let failed = |what: &str, e| io_error(&format!("{what} in {}", dir.display()), e);
        let mut floor = 0;
        let mut legacy = Vec::new();
        for entry in std::fs::read_dir(dir)
            .map_err(|e| failed("listing", e))?
            .flatten()
        {
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str().and_then(|f| f.strip_suffix("#token")) else {
                continue;
            };
            let bytes = std::fs::read(entry.path()).map_err(|e| failed("reading", e))?;
            let value = match <[u8; 8]>::try_from(bytes.as_slice()) {
                Ok(bytes) => u64::from_le_bytes(bytes),
                Err(_) if bytes.is_empty() => 0,
                Err(_) => {
                    return Err(Error::backend(
                        format!(
                            "{name}#token holds {} bytes, not a counter; refusing to guess a token",
                            bytes.len()
                        ),
                        false,
                    ));
                }
            };
            floor = floor.max(value);
            legacy.push(entry.path());
        }
        static ASIDE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let aside = dir.join(format!(
            "{TOKENS}-{}-{}",
            std::process::id(),
            ASIDE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let counters: Vec<u8> = (0..TOKEN_SHARDS)
            .flat_map(|_| floor.to_le_bytes())
            .collect();
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&aside)
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, &counters)?;
                f.sync_all()
            })
            .and_then(|()| match std::fs::hard_link(&aside, dir.join(TOKENS)) {
                // Another process made it first: use theirs.
                Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
                other => other,
            });
        let _ = std::fs::remove_file(&aside);
        written.map_err(|e| failed("creating the fencing counters", e))?;
        for path in legacy {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }

    fn write_record(&self, req: &Request, held: Option<FencingToken>) -> Result<()> {
        let mut record = format!(
            "pid={}\nmode={}\nstate={}\n",
            std::process::id(),
            mode_text(req.mode),
            if held.is_some() { "held" } else { "waiting" },
        );
        if let Some(token) = held {
            record.push_str(&format!("token={token}\n"));
        }
        if let Some(value) = &req.value {
            record.push_str(&format!("value={}\n", hex(value)));
        }
        let path = self.record_path(&req.name, &req.owner);
        // Written under a temporary name and renamed, so a reader never sees half a record.
        let tmp = self.path(&req.name, &format!("tmp-{}", req.owner));
        std::fs::write(&tmp, record)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| io_error(&format!("writing {}", path.display()), e))
    }

    fn record_path(&self, name: &LockName, owner: &OwnerId) -> PathBuf {
        self.path(name, &format!("who-{owner}"))
    }

    fn remove_record(&self, name: &LockName, owner: &OwnerId) {
        let _ = std::fs::remove_file(self.record_path(name, owner));
    }

    /// Records of `name`, with records of dead processes removed.
    fn records(&self, name: &LockName) -> Result<Vec<(OwnerId, Record)>> {
        let prefix = format!("{name}#who-");
        let entries = std::fs::read_dir(&self.inner.dir)
            .map_err(|e| io_error(&format!("listing {}", self.inner.dir.display()), e))?;
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(owner) = file_name.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
                continue;
            };
            let Ok(owner) = OwnerId::parse(owner) else {
                continue;
            };
            let Ok(text) = std::fs::read_to_string(entry.path()) else {
                continue;
            };
            let Some(record) = Record::parse(&text) else {
                continue;
            };
            if self.is_stale(&owner, &record) {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            records.push((owner, record));
        }
        records.sort_by_key(|(_, r)| r.token.map(FencingToken::get).unwrap_or(u64::MAX));
        Ok(records)
    }

    fn is_stale(&self, owner: &OwnerId, record: &Record) -> bool {
        if record.pid == std::process::id() {
            let state = self.state();
            return !state.held.contains_key(owner) && !state.waiting.contains_key(owner);
        }
        let Some(pid) = rustix::process::Pid::from_raw(record.pid as i32) else {
            return true;
        };
        rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
    }
}

/// The default lock directory.
/// `$XDG_RUNTIME_DIR/leasehold` when the session has a runtime directory, otherwise
/// `leasehold-<uid>` in the system temporary directory.
pub fn default_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if Path::new(&dir).is_dir() => Path::new(&dir).join("leasehold"),
        _ => std::env::temp_dir().join(format!("leasehold-{}", rustix::process::getuid().as_raw())),
    }
}

fn reuse<T>(slot: &mut Option<T>, open: impl FnOnce() -> Result<T>) -> Result<&mut T> {
    let value = match slot.take() {
        Some(value) => value,
        None => open()?,
    };
    Ok(slot.insert(value))
}

fn open_rw(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|e| io_error(&format!("opening {}", path.display()), e))
}

/// Whether `file` is (still) the file at `path`.
fn is_linked(file: &File, path: &Path) -> Result<bool> {
    let failed = |e| io_error(&format!("checking {}", path.display()), e);
    let open = file.metadata().map_err(failed)?;
    match std::fs::metadata(path) {
        Ok(linked) => Ok(open.dev() == linked.dev() && open.ino() == linked.ino()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(failed(e)),
    }
}

/// Locks the counter at `offset` of the counters file without waiting.
#[cfg(target_os = "linux")]
fn lock_counter(file: &File, offset: u64) -> Result<bool> {
    ofd::try_lock(file, ofd::Range::new(offset, 8))
        .map_err(|e| io_error("locking a fencing counter", e))
}

/// Locks the counters file without waiting (no byte-range locks of descriptions here).
#[cfg(not(target_os = "linux"))]
fn lock_counter(file: &File, _offset: u64) -> Result<bool> {
    try_flock(file, FlockOperation::NonBlockingLockExclusive)
}

/// FNV-1a: a hash that every process and version computes the same.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A non-blocking `flock`: `Ok(false)` when someone else holds a conflicting lock.
fn try_flock(file: &File, op: FlockOperation) -> Result<bool> {
    match flock(file, op) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(io_error("flock", e.into())),
    }
}

fn io_error(what: &str, error: std::io::Error) -> Error {
    Error::Backend {
        message: format!("{what}: {error}"),
        retryable: false,
        source: Some(Arc::new(error)),
    }
}

fn mode_text(mode: Mode) -> String {
    match mode {
        Mode::Exclusive => "exclusive".into(),
        Mode::Shared => "shared".into(),
        Mode::Permit { limit } => format!("permit/{limit}"),
    }
}

fn parse_mode(text: &str) -> Option<Mode> {
    match text {
        "exclusive" => Some(Mode::Exclusive),
        "shared" => Some(Mode::Shared),
        _ => {
            let limit = text.strip_prefix("permit/")?.parse().ok()?;
            Some(Mode::Permit { limit })
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A holder or waiter record, as written by [`FileBackend::write_record`].
#[derive(Debug)]
struct Record {
    pid: u32,
    mode: Mode,
    held: bool,
    token: Option<FencingToken>,
    value: Option<Vec<u8>>,
}

impl Record {
    fn parse(text: &str) -> Option<Record> {
        let fields: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        Some(Record {
            pid: fields.get("pid")?.parse().ok()?,
            mode: parse_mode(fields.get("mode")?)?,
            held: *fields.get("state")? == "held",
            token: match fields.get("token") {
                Some(t) => Some(FencingToken::new(t.parse().ok()?)),
                None => None,
            },
            value: match fields.get("value") {
                Some(v) => Some(unhex(v)?),
                None => None,
            },
        })
    }
}

#[async_trait]
impl Backend for FileBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("file", TokenDurability::Durable);
        caps.push_wakeups = cfg!(target_os = "linux");
        caps.shared = true;
        caps.permits = cfg!(target_os = "linux");
        caps
    }

    async fn acquire(&self, req: &Request) -> Result<Acquire> {
        // Read the version before trying, so a release right after the try still wakes us.
        let version = self.inner.notifier.version(req.name.as_str());
        let mut files = {
            let mut state = self.state();
            if let Some(held) = state.held.get(&req.owner) {
                return Ok(Acquire::Granted(Grant::new(held.token, Expiry::Never)));
            }
            state.waiting.remove(&req.owner).unwrap_or_default()
        };
        files.name = Some(req.name.clone());
        // An owner goes into `STATE` before its record is written: `inspect` deletes a
        // record of this process whose owner is not in there.
        if !self.try_lock(req, &mut files)? {
            if req.waiting {
                let unrecorded = !files.recorded;
                files.recorded = true;
                self.state().waiting.insert(req.owner.clone(), files);
                if unrecorded && let Err(error) = self.write_record(req, None) {
                    let waiting = self.state().waiting.remove(&req.owner);
                    drop(waiting);
                    return Err(error);
                }
            }
            return Ok(Acquire::Busy(WaitHint::new(version)));
        }
        // The kernel lock is ours; on any error below, dropping `files` gives it back.
        let token = self.next_token(&req.name).await?;
        self.state().held.insert(
            req.owner.clone(),
            Held {
                name: req.name.clone(),
                token,
                files,
            },
        );
        if let Err(error) = self.write_record(req, Some(token)) {
            let held = self.state().held.remove(&req.owner);
            drop(held);
            return Err(error);
        }
        Ok(Acquire::Granted(Grant::new(token, Expiry::Never)))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        Ok(if self.state().held.contains_key(&req.owner) {
            Renewal::Renewed(Expiry::Never)
        } else {
            Renewal::Lost(LossReason::NotOwner)
        })
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let (held, waiting) = {
            let mut state = self.state();
            (
                state.held.remove(&req.owner),
                state.waiting.remove(&req.owner),
            )
        };
        let name = held
            .as_ref()
            .map(|h| h.name.clone())
            .or_else(|| waiting.as_ref().and_then(|w| w.name.clone()));
        let Some(name) = name else {
            return Ok(Release::NotHeld);
        };
        // Remove the record first: once the descriptors close, the next holder may write
        // its own.
        self.remove_record(&name, &req.owner);
        drop((held, waiting));
        Ok(Release::Released)
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.inner.notifier.wait(hint.get::<Ticket>(), max).await;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let version = self.inner.notifier.version(name.as_str());
        let mut state = LockState::new(WaitHint::new(version));
        for (owner, record) in self.records(name)? {
            if record.held {
                state.holders.push(
                    Holder::new(
                        owner,
                        record.mode,
                        record.token.unwrap_or(FencingToken::new(0)),
                    )
                    .with_remaining(None)
                    .with_value(record.value.map(Into::into)),
                );
            } else {
                state.waiters.push(Waiter::new(owner, record.mode));
            }
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use std::time::Duration;

    use leasehold_core::Client;

    use super::*;

    /// A temporary lock directory on a memory file system where there is one.
    /// There, 100,000 fsyncs of the fencing counter are cheap.
    fn scratch_dir() -> tempfile::TempDir {
        match Path::new("/dev/shm") {
            shm if shm.is_dir() => tempfile::tempdir_in(shm).unwrap(),
            _ => tempfile::tempdir().unwrap(),
        }
    }

    fn open_descriptors() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn per_name_state_returns_to_its_baseline_after_100_000_names() {
        let dir = scratch_dir();
        let backend = FileBackend::open(dir.path()).unwrap();
        let client = Client::new(backend.clone());
        let rival = Client::new(FileBackend::open(dir.path()).unwrap());
        // Once, so that the notifier's reader and the runtime's own descriptors exist.
        client
            .mutex("warm-up")
            .unwrap()
            .lock()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let descriptors = open_descriptors();
        for i in 0..100_000 {
            let name = format!("order-{i}");
            let guard = client.mutex(&name).unwrap().lock().await.unwrap();
            if i % 1000 == 0 {
                // Now and then also a waiter that gives up, an inspection, and a permit.
                let waited = rival
                    .mutex(&name)
                    .unwrap()
                    .lock_timeout(Duration::from_millis(1))
                    .await
                    .unwrap();
                assert!(waited.is_none());
                assert_eq!(client.inspect(&name).await.unwrap().holders.len(), 1);
                let permit = client.semaphore(&name, 3).unwrap().acquire().await.unwrap();
                permit.release().await.unwrap();
            }
            guard.release().await.unwrap();
        }
        client.settle().await;
        rival.settle().await;
        assert_eq!(backend.inner.notifier.tracked_names(), 0);
        assert_eq!(open_descriptors(), descriptors);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert!(
            left.len() <= 2,
            "files left behind: {:?}…",
            &left[..left.len().min(10)]
        );
    }
}
