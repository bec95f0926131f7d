//! leasehold's local embedded backend: cross-process locks on one host through OS file
//! locks (`flock`).
//!
//! The kernel releases a file lock when the process holding it dies, however it dies, so
//! grants here never expire and need no renewal: a holder keeps its lock until it releases
//! it or exits. That makes this backend a good default for one machine (cron jobs, CLI
//! tools, tests) and a poor one for anything that spans machines: use a server backend for
//! that (and note that NFS file locking is not reliable enough to build on).
//!
//! # Files
//!
//! For a lock name `N`, the lock directory holds:
//!
//! | file | purpose |
//! |---|---|
//! | `N#lock` | `flock` exclusive (mutex, writer, leader) or shared (reader) |
//! | `N#gate` | writer preference: a waiting writer holds it, new readers queue behind |
//! | `N#sem-K` | permit slot `K` of a semaphore (one exclusive `flock` each) |
//! | `N#token` | the fencing counter: 8 bytes, bumped under its own `flock`, fsynced |
//! | `N#who-OWNER` | holder / waiter record for `inspect` (pid, mode, token, value) |
//!
//! `#` never occurs in a lock name, so no name's files collide with another's. Lock files
//! are never deleted (deleting a locked file lets a newcomer lock a fresh inode while the
//! old holder still believes it holds the lock); do not delete them by hand while locks are
//! in use.
//!
//! # Guarantees
//!
//! - Mutual exclusion between all processes (and all clients in one process) using the same
//!   directory on one host, for as long as nobody deletes the lock files.
//! - A holder that dies releases at once: no TTL to wait out.
//! - Fencing tokens strictly increase per name for as long as the `N#token` file survives:
//!   across process restarts always; across reboots only if the directory is on persistent
//!   storage (the default directory under `$XDG_RUNTIME_DIR` is usually a tmpfs, reset at
//!   boot — point `file:///var/lib/...` at persistent storage if a protected resource
//!   outlives reboots).
//! - Waiters are woken by inotify when a holder releases or dies; no polling on Linux.
//! - No FIFO queue: waiters race for a released lock. Readers do queue behind a waiting
//!   writer, so writers are not starved.

mod notify;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, LockState, Mode, Release, Renewal,
    Request, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::{Error, FencingToken, LockName, LossReason, OwnerId, Result};
use rustix::fs::{FlockOperation, flock};

use crate::notify::Notifier;

/// The file-lock backend. Clones share their state; separate instances (in one process or
/// many) on the same directory exclude each other through the kernel.
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
}

/// What this process holds and waits for, by owner id (unique per acquisition), across all
/// instances: a record naming this process is live exactly while its owner is in here.
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
    _files: Files,
}

/// Descriptors of one acquisition. A waiter keeps them between tries, so that its tries do
/// not close (and signal) anything.
#[derive(Debug, Default)]
struct Files {
    name: Option<LockName>,
    lock: Option<File>,
    gate: Option<File>,
    slots: Vec<File>,
    recorded: bool,
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
            inner: Arc::new(Inner { dir, notifier }),
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

    /// Opens a lock file for writing (so that closing it signals waiters).
    fn open_rw(&self, name: &LockName, kind: &str) -> Result<File> {
        let path = self.path(name, kind);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| io_error(&format!("opening {}", path.display()), e))
    }

    /// Opens a lock file read-only (closing it signals nothing).
    fn open_ro(&self, name: &LockName, kind: &str) -> Result<File> {
        match File::open(self.path(name, kind)) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                drop(self.open_rw(name, kind)?);
                File::open(self.path(name, kind))
            }
            other => other,
        }
        .map_err(|e| io_error(&format!("opening {name}#{kind}"), e))
    }

    /// Tries the kernel locks for `req`, reusing and keeping `files`. `Ok(true)`: granted.
    fn try_lock(&self, req: &Request, files: &mut Files) -> Result<bool> {
        let name = &req.name;
        match req.mode {
            Mode::Exclusive => {
                if req.waiting && files.gate.is_none() {
                    // Announce a waiting writer: new readers queue behind it.
                    let gate = self.open_rw(name, "gate")?;
                    if !try_flock(&gate, FlockOperation::NonBlockingLockExclusive)? {
                        return Ok(false);
                    }
                    files.gate = Some(gate);
                }
                let lock = reuse(&mut files.lock, || self.open_rw(name, "lock"))?;
                let granted = try_flock(lock, FlockOperation::NonBlockingLockExclusive)?;
                if granted {
                    files.gate = None;
                }
                Ok(granted)
            }
            Mode::Shared => {
                // Read-only, so that taking and dropping the gate signals nothing.
                let gate = self.open_ro(name, "gate")?;
                if !try_flock(&gate, FlockOperation::NonBlockingLockShared)? {
                    return Ok(false);
                }
                let lock = reuse(&mut files.lock, || self.open_rw(name, "lock"))?;
                try_flock(lock, FlockOperation::NonBlockingLockShared)
            }
            Mode::Permit { limit } => {
                let limit = limit.get() as usize;
                while files.slots.len() < limit {
                    let slot = self.open_rw(name, &format!("sem-{}", files.slots.len()))?;
                    files.slots.push(slot);
                }
                for k in 0..limit {
                    if try_flock(&files.slots[k], FlockOperation::NonBlockingLockExclusive)? {
                        let slot = files.slots.swap_remove(k);
                        files.slots = vec![slot];
                        return Ok(true);
                    }
                }
                Ok(false)
            }
        }
    }

    /// Bumps and returns the fencing counter of `name`.
    async fn next_token(&self, name: &LockName) -> Result<FencingToken> {
        let mut file = self.open_rw(name, "token")?;
        // Another process holds the counter only for a read and a write; wait for it
        // without blocking the runtime.
        let mut pause = Duration::from_micros(100);
        while !try_flock(&file, FlockOperation::NonBlockingLockExclusive)? {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
        let counter_error = |e| io_error(&format!("updating {name}#token"), e);
        let mut bytes = Vec::with_capacity(8);
        file.read_to_end(&mut bytes).map_err(counter_error)?;
        let last = match bytes.len() {
            0 => 0,
            8 => u64::from_le_bytes(bytes.try_into().unwrap_or_default()),
            n => {
                return Err(Error::backend(
                    format!(
                        "{name}#token holds {n} bytes, not a counter; refusing to guess a token"
                    ),
                    false,
                ));
            }
        };
        let next = last.checked_add(1).ok_or_else(|| {
            Error::backend(format!("the fencing counter of {name} is exhausted"), false)
        })?;
        file.seek(SeekFrom::Start(0)).map_err(counter_error)?;
        file.write_all(&next.to_le_bytes()).map_err(counter_error)?;
        file.sync_data().map_err(counter_error)?;
        Ok(FencingToken::new(next))
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

/// The default lock directory: `$XDG_RUNTIME_DIR/leasehold` when the session has a runtime
/// directory, otherwise `leasehold-<uid>` in the system temporary directory.
pub fn default_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if Path::new(&dir).is_dir() => Path::new(&dir).join("leasehold"),
        _ => std::env::temp_dir().join(format!("leasehold-{}", rustix::process::getuid().as_raw())),
    }
}

fn reuse(slot: &mut Option<File>, open: impl FnOnce() -> Result<File>) -> Result<&File> {
    if slot.is_none() {
        *slot = Some(open()?);
    }
    slot.as_ref()
        .ok_or_else(|| Error::backend("a lock file descriptor went missing", false))
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
        caps.permits = true;
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
        if !self.try_lock(req, &mut files)? {
            if req.waiting {
                if !files.recorded {
                    self.write_record(req, None)?;
                    files.recorded = true;
                }
                self.state().waiting.insert(req.owner.clone(), files);
            }
            return Ok(Acquire::Busy(WaitHint::new(version)));
        }
        // The kernel lock is ours; on any error below, dropping `files` gives it back.
        let token = self.next_token(&req.name).await?;
        self.write_record(req, Some(token))?;
        self.state().held.insert(
            req.owner.clone(),
            Held {
                name: req.name.clone(),
                token,
                _files: files,
            },
        );
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

    async fn wait(&self, name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.inner
            .notifier
            .wait(name.as_str(), hint.get::<u64>().copied(), max)
            .await;
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
