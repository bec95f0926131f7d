//! `N#who-OWNER`: the record of a holder or waiter, which is what `inspect` reads.
//!
//! A record holds the pid, mode, state, token and value of one acquisition, one `key=value`
//! a line. It is written under a temporary name and renamed into place, and removed on
//! release; records of dead processes are removed by whoever reads them. (The records a
//! holder keeps beside a lock, `put_record`'s, are another thing: `notes.rs`.)

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use leasehold_core::backend::{Mode, Request};
use leasehold_core::{FencingToken, LockName, OwnerId, Result};
use rustix::io::Errno;

use crate::FileBackend;
use crate::acquisitions::{Status, acquisitions};
use crate::directory::io_error;
use crate::notes::NOTES;

impl FileBackend {
    /// Writes (or replaces) the record of `req`, saying `status`.
    pub(crate) fn write_record(&self, req: &Request, status: Status) -> Result<()> {
        let mut record = format!("pid={}\nmode={}\n", std::process::id(), req.mode);
        match status {
            Status::Waiting => record.push_str("state=waiting\n"),
            Status::Held(token) => record.push_str(&format!("state=held\ntoken={token}\n")),
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

    pub(crate) fn remove_record(&self, name: &LockName, owner: &OwnerId) {
        let _ = std::fs::remove_file(self.record_path(name, owner));
    }

    /// Records of `name`, with records of dead acquisitions removed.
    pub(crate) fn records(&self, name: &LockName) -> Result<Vec<(OwnerId, Record)>> {
        let records = self.scan(|candidate| candidate == name.as_str())?;
        Ok(records
            .into_iter()
            .map(|(_, owner, r)| (owner, r))
            .collect())
    }

    /// Records of every lock name `wanted` accepts, in one pass over the directory.
    /// Records of dead acquisitions are removed.
    pub(crate) fn scan(
        &self,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<Vec<(LockName, OwnerId, Record)>> {
        let entries = std::fs::read_dir(&self.inner.dir)
            .map_err(|e| io_error(&format!("listing {}", self.inner.dir.display()), e))?;
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(file_name) = file_name.to_str() else {
                continue;
            };
            // A name's notes (`N#notes`, records kept beside it) are not a holder or a
            // waiter: only swept of expired ones.
            if let Some(name) = (file_name.strip_suffix(NOTES)).and_then(|f| f.strip_suffix('#')) {
                if wanted(name)
                    && let Ok(name) = LockName::new(name)
                {
                    self.sweep_notes(&name);
                }
                continue;
            }
            // Names never contain '#', so the split is unambiguous.
            let Some((name, owner)) = file_name.split_once("#who-") else {
                continue;
            };
            if !wanted(name) {
                continue;
            }
            let (Ok(name), Ok(owner)) = (LockName::new(name), OwnerId::parse(owner)) else {
                continue;
            };
            let Some(record) = Record::read(&entry.path()) else {
                continue;
            };
            if self.is_stale(&owner, &record) {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            records.push((name, owner, record));
        }
        Ok(records)
    }

    /// Whether `record` is left over by an acquisition that is gone, or a process that is.
    fn is_stale(&self, owner: &OwnerId, record: &Record) -> bool {
        if record.pid == std::process::id() {
            return !acquisitions().contains_key(owner);
        }
        rustix::process::Pid::from_raw(record.pid as i32).is_none_or(|pid| {
            rustix::process::test_kill_process(pid) == Err(Errno::SRCH) || is_zombie(record.pid)
        })
    }
}

/// Whether process `pid` has exited and waits to be reaped (its locks are gone already).
/// A record's holder that was killed is a zombie until its parent reaps it, and nothing on
/// the lock's files changes when that happens.
fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // `pid (comm) S …`: the state follows the last ')' (comm may hold one).
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
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
pub(crate) struct Record {
    pid: u32,
    pub(crate) mode: Mode,
    pub(crate) status: Status,
    pub(crate) value: Option<Vec<u8>>,
    /// When the record was written: for a holder, when its grant was made.
    pub(crate) written: Option<SystemTime>,
}

impl Record {
    /// The record in the file at `path`; `None` if there is none, or it does not parse.
    fn read(path: &Path) -> Option<Record> {
        let text = std::fs::read_to_string(path).ok()?;
        let written = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let fields: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        Some(Record {
            pid: fields.get("pid")?.parse().ok()?,
            mode: parse_mode(fields.get("mode")?)?,
            status: match *fields.get("state")? {
                "held" => Status::Held(FencingToken::new(fields.get("token")?.parse().ok()?)),
                _ => Status::Waiting,
            },
            value: match fields.get("value") {
                Some(v) => Some(unhex(v)?),
                None => None,
            },
            written,
        })
    }
}
