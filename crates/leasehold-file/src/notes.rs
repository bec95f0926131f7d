//! `N#notes/KEY`: records kept beside a lock name for a while (a job's completion records).
//!
//! Not the holder and waiter records of `records.rs`: these are the values of
//! [`Backend::put_record`](leasehold_core::Backend::put_record), written by a holder and
//! read by anyone. A name's notes live in a directory of their own, `N#notes`, so that no
//! note's file name can be taken for a lock file or a holder record, and so that a lock
//! name and a key of full length still make file names the system accepts.
//!
//! A note is one file named after its key: its first line is `expires_ms=` and the
//! wall-clock time (Unix ms) after which it is no longer kept, and the value follows. It is
//! written under a temporary name (`KEY#tmp`; `#` never occurs in a key) and renamed into
//! place, so a reader never sees half a note.
//!
//! Whoever writes, sweeps or removes the directory holds an exclusive `flock` on it while
//! doing so; readers take none. So a sweep never deletes a note that was just replaced by a
//! fresh one, and the directory is removed (when a sweep leaves it empty) only while no
//! writer is between creating it and renaming its note in. Expired notes are swept by the
//! writer of another note of the name, by a reader that finds one expired, and by `list`
//! and `inspect` of the name; a note is never deleted before its expiry.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_core::backend::Request;
use leasehold_core::{Error, LockName, RecordKey, Result};
use rustix::fs::FlockOperation;

use crate::FileBackend;
use crate::acquisitions::{acquisitions, holds};
use crate::directory::{io_error, is_linked};
use crate::lock_files::try_flock;

/// The kind of a name's notes directory: `N#notes`.
pub(crate) const NOTES: &str = "notes";

/// How many times a writer makes the notes directory anew when it is removed under it.
const ATTEMPTS: usize = 100;

impl FileBackend {
    /// Writes `value` as `req.name`'s note `key`, kept `keep`, if `req`'s grant is held here.
    /// Expired notes of the name are swept first.
    ///
    /// Cancel safety: it awaits only while waiting for the notes directory's lock, before
    /// writing anything; from there it runs to the end without yielding.
    pub(crate) async fn put_note(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        // Not held: nothing to do, and no directory made for nothing.
        if !holds(&acquisitions(), req) {
            return Ok(false);
        }
        let notes = Notes::lock(self.notes_path(&req.name)).await?;
        let now = now_ms().ok_or_else(|| {
            Error::backend(
                "the wall clock reads before 1970: cannot date a record",
                false,
            )
        })?;
        let expires = now.saturating_add(u64::try_from(keep.as_millis()).unwrap_or(u64::MAX));
        notes.sweep(now)?;

        let path = notes.path.join(key.as_str());
        let tmp = notes.path.join(format!("{key}#tmp"));
        let failed = |e| io_error(&format!("writing {}", path.display()), e);
        let mut note = format!("expires_ms={expires}\n").into_bytes();
        note.extend_from_slice(value);
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut file| {
                file.write_all(&note)?;
                file.sync_data()
            });
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            notes.remove_if_empty();
            return Err(failed(e));
        }

        // The check and the rename under the lock of this process's acquisitions, which
        // every release takes to take the grant out before closing its descriptors. So
        // while it is locked, a grant found held keeps its kernel lock (an `flock` or an
        // open-file-description lock, which the kernel holds for this process until those
        // descriptors close), and no other process can be granted a conflicting lock of the
        // name until the note is in place: the note is fenced by the grant. A release in this
        // process waits here, and one that came first makes the check fail.
        let renamed = {
            let table = acquisitions();
            if holds(&table, req) {
                Some(std::fs::rename(&tmp, &path))
            } else {
                None
            }
        };
        match renamed {
            None => {
                let _ = std::fs::remove_file(&tmp);
                notes.remove_if_empty();
                Ok(false)
            }
            Some(Err(e)) => {
                let _ = std::fs::remove_file(&tmp);
                notes.remove_if_empty();
                Err(failed(e))
            }
            // The rename is durable once the directory is synced.
            Some(Ok(())) => notes.sync().map(|()| true),
        }
    }

    /// The note `key` of `name`, unless there is none or it has expired.
    /// Finding one expired, it sweeps the name's notes if nobody else is at them.
    pub(crate) fn get_note(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        let path = self.notes_path(name).join(key.as_str());
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(&format!("reading {}", path.display()), e)),
        };
        let (expires, value) = decode(&bytes).ok_or_else(|| {
            Error::backend(
                format!("{} is not a record of this backend", path.display()),
                false,
            )
        })?;
        if now_ms().is_some_and(|now| expires <= now) {
            self.sweep_notes(name);
            return Ok(None);
        }
        Ok(Some(value.to_vec()))
    }

    /// Sweeps `name`'s expired notes, and its notes directory if that leaves it empty.
    /// Best effort: it does nothing if another process or task is at them.
    pub(crate) fn sweep_notes(&self, name: &LockName) {
        let Some(now) = now_ms() else {
            return;
        };
        if let Ok(Some(notes)) = Notes::try_lock(self.notes_path(name))
            && notes.sweep(now).is_ok()
        {
            notes.remove_if_empty();
        }
    }

    fn notes_path(&self, name: &LockName) -> PathBuf {
        self.path(name, NOTES)
    }
}

/// A name's notes directory, locked exclusively while this lives (closing it unlocks).
struct Notes {
    path: PathBuf,
    dir: File,
    /// Whether this made the directory (its entry in the lock directory is then synced too).
    created: bool,
}

impl Notes {
    /// Makes the directory at `path` if missing and locks it.
    /// It waits for other writers and sweepers (each holds it for a few file operations).
    async fn lock(path: PathBuf) -> Result<Self> {
        let mut pause = Duration::from_micros(100);
        for _ in 0..ATTEMPTS {
            let created = match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => true,
                Err(e) if e.kind() == ErrorKind::AlreadyExists => false,
                Err(e) => return Err(io_error(&format!("creating {}", path.display()), e)),
            };
            let Some(dir) = open_dir(&path)? else {
                continue;
            };
            while !try_flock(&dir, FlockOperation::NonBlockingLockExclusive)? {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            // A sweep may have removed it while we waited: then make it anew.
            if is_linked(&dir, &path)? {
                return Ok(Self { path, dir, created });
            }
        }
        Err(Error::backend(
            format!(
                "{} was removed under every attempt to write in it",
                path.display()
            ),
            true,
        ))
    }

    /// Locks the directory at `path` without waiting: `None` if it is missing or in use.
    fn try_lock(path: PathBuf) -> Result<Option<Self>> {
        let Some(dir) = open_dir(&path)? else {
            return Ok(None);
        };
        if !try_flock(&dir, FlockOperation::NonBlockingLockExclusive)? || !is_linked(&dir, &path)? {
            return Ok(None);
        }
        Ok(Some(Self {
            path,
            dir,
            created: false,
        }))
    }

    /// Deletes the expired notes as of `now` (Unix ms), and temporary files.
    /// A temporary file here is left over: a writer holds the directory's lock from
    /// creating one to renaming it. Files that are not notes are left alone.
    fn sweep(&self, now: u64) -> Result<()> {
        let entries = std::fs::read_dir(&self.path)
            .map_err(|e| io_error(&format!("listing {}", self.path.display()), e))?;
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(file_name) = file_name.to_str() else {
                continue;
            };
            let expired = if file_name.contains('#') {
                true
            } else if RecordKey::new(file_name).is_ok() {
                std::fs::read(entry.path())
                    .ok()
                    .and_then(|bytes| decode(&bytes).map(|(expires, _)| expires <= now))
                    .unwrap_or(false)
            } else {
                false
            };
            if expired {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }

    /// Removes the directory if it holds nothing (the system refuses otherwise).
    fn remove_if_empty(&self) {
        let _ = std::fs::remove_dir(&self.path);
    }

    /// Makes the directory's entries durable (and its own, if this made it).
    fn sync(&self) -> Result<()> {
        let failed = |path: &Path, e| io_error(&format!("syncing {}", path.display()), e);
        self.dir.sync_all().map_err(|e| failed(&self.path, e))?;
        if self.created
            && let Some(parent) = self.path.parent()
        {
            File::open(parent)
                .and_then(|dir| dir.sync_all())
                .map_err(|e| failed(parent, e))?;
        }
        Ok(())
    }
}

/// Opens the directory at `path` (to lock it); `None` if it is missing.
fn open_dir(path: &Path) -> Result<Option<File>> {
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(path)
    {
        Ok(dir) => Ok(Some(dir)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error(&format!("opening {}", path.display()), e)),
    }
}

/// A note's expiry (Unix ms) and value; `None` if `bytes` is not a note.
fn decode(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let end = bytes.iter().position(|&b| b == b'\n')?;
    let (first, rest) = bytes.split_at(end);
    let expires = std::str::from_utf8(first.strip_prefix(b"expires_ms=")?)
        .ok()?
        .parse()
        .ok()?;
    Some((expires, rest.get(1..)?))
}

/// The wall clock in Unix ms; `None` before 1970.
fn now_ms() -> Option<u64> {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    Some(u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use super::*;

    #[test]
    fn a_note_decodes_to_its_expiry_and_value() {
        assert_eq!(decode(b"expires_ms=5\nab\ncd"), Some((5, &b"ab\ncd"[..])));
        assert_eq!(decode(b"expires_ms=5\n"), Some((5, &b""[..])));
        assert_eq!(decode(b"expires_ms=5"), None);
        assert_eq!(decode(b"expires_ms=x\nab"), None);
        assert_eq!(decode(b"pid=5\nab"), None);
        assert_eq!(decode(b""), None);
    }
}
