//! `#tokens`: the fencing counters of all names, 1024 counters of 8 bytes.
//!
//! A name's counter is chosen by a hash of the name (FNV-1a), so a name's tokens strictly
//! increase while names spread over the counters. Each counter is bumped under its own
//! byte-range lock and fsynced. The file is created whole, written aside and linked into
//! place; a file of another size is refused rather than guessed from.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::{Error, FencingToken, LockName, Result};

use crate::directory::io_error;

/// The file of the fencing counters.
const TOKENS: &str = "#tokens";
/// How many counters it holds.
const TOKEN_SHARDS: u64 = 1024;

/// Bumps and returns the fencing counter of `name` in the lock directory `dir`.
pub(crate) async fn next_token(dir: &Path, name: &LockName) -> Result<FencingToken> {
    let file = open(dir)?;
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
fn open(dir: &Path) -> Result<File> {
    let path = dir.join(TOKENS);
    let file = match OpenOptions::new().read(true).write(true).open(&path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            create(dir)?;
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
fn create(dir: &Path) -> Result<()> {
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
    static ASIDE: AtomicU64 = AtomicU64::new(0);
    let (pid, n) = (std::process::id(), ASIDE.fetch_add(1, Ordering::Relaxed));
    let aside = dir.join(format!("{TOKENS}-{pid}-{n}"));
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

/// Locks the counter at `offset` of the counters file without waiting.
#[cfg(target_os = "linux")]
fn lock_counter(file: &File, offset: u64) -> Result<bool> {
    crate::ofd::try_lock(file, crate::ofd::Range::new(offset, 8))
        .map_err(|e| io_error("locking a fencing counter", e))
}

/// Locks the counters file without waiting (no byte-range locks of descriptions here).
#[cfg(not(target_os = "linux"))]
fn lock_counter(file: &File, _offset: u64) -> Result<bool> {
    crate::lock_files::try_flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
}

/// FNV-1a: a hash that every process and version computes the same.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
