//! The [`Backend`] implementation: each request as kernel locks, a token and a record.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use leasehold_core::backend::{
    Acquire, Backend, Capabilities, Expiry, Grant, Holder, ListCursor, Listing, LockState, Release,
    Renewal, Request, TokenDurability, WaitHint, Waiter,
};
use leasehold_core::support::wakeups::Ticket;
use leasehold_core::{Error, LockName, LossReason, NamePrefix, OwnerId, RecordKey, Result};

use crate::FileBackend;
use crate::acquisitions::{Acquisition, Files, Status, acquisitions};
use crate::records::Record;
use crate::tokens::next_token;

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
        // Take the ticket before trying, so a release right after the try still wakes us.
        let ticket = self.inner.notifier.ticket(req.name.as_str());
        let (mut files, recorded) = {
            let mut acquisitions = acquisitions();
            match acquisitions.get_mut(&req.owner) {
                Some(earlier) => match earlier.status {
                    Status::Held(token) => {
                        return Ok(Acquire::Granted(Grant::new(token, Expiry::Never)));
                    }
                    // A waiter trying again stays in, so that its record stays live.
                    Status::Waiting => (std::mem::take(&mut earlier.files), true),
                },
                None => (Files::default(), false),
            }
        };
        if !files.try_lock(self, req)? {
            if req.waiting {
                self.enter(req, Status::Waiting, files, !recorded)?;
            }
            return Ok(Acquire::Busy(WaitHint::new(ticket)));
        }
        // The kernel lock is ours; on any error below, dropping `files` gives it back (a
        // waiter stays in until it is released).
        let token = next_token(&self.inner.dir, &req.name).await?;
        self.enter(req, Status::Held(token), files, true)?;
        Ok(Acquire::Granted(Grant::new(token, Expiry::Never)))
    }

    async fn renew(&self, req: &Request) -> Result<Renewal> {
        Ok(match acquisitions().get(&req.owner).map(|a| a.status) {
            Some(Status::Held(_)) => Renewal::Renewed(Expiry::Never),
            _ => Renewal::Lost(LossReason::NotOwner),
        })
    }

    async fn release(&self, req: &Request) -> Result<Release> {
        let Some(acquisition) = acquisitions().remove(&req.owner) else {
            return Ok(Release::NotHeld);
        };
        // Remove the record first: once the descriptors close, the next holder may write
        // its own.
        self.remove_record(&acquisition.name, &req.owner);
        drop(acquisition);
        Ok(Release::Released)
    }

    async fn wait(&self, _name: &LockName, hint: &WaitHint, max: Duration) -> Result<()> {
        self.inner.notifier.wait(hint.get::<Ticket>(), max).await;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<LockState> {
        let ticket = self.inner.notifier.ticket(name.as_str());
        let mut state = state_of(self.records(name)?);
        state.hint = WaitHint::new(ticket);
        Ok(state)
    }

    /// Writes the record as a note in `N#notes`, if this process holds `req`'s grant.
    /// See `notes.rs`: the check and the rename into place run under the lock of this
    /// process's acquisitions, which a release takes before closing the grant's descriptors.
    ///
    /// # Cancel safety
    ///
    /// Dropped while it waits for the notes directory's lock, it has written nothing; after
    /// that it does not yield.
    async fn put_record(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        self.put_note(req, key, value, keep).await
    }

    async fn get_record(&self, name: &LockName, key: &RecordKey) -> Result<Option<Vec<u8>>> {
        self.get_note(name, key)
    }

    /// Unsupported: a file lock never expires.
    /// It ends with its holder's descriptors, so nothing could be left behind that would
    /// end by itself.
    async fn keep(&self, _req: &Request, _hold: Duration) -> Result<bool> {
        Err(Error::Unsupported {
            backend: "file",
            feature: "holding a lock after its holder lets go (--at-least; a file lock \
                      has no expiry: it ends when its holder releases it or exits)",
        })
    }

    /// A feed of the directory's file events: inotify, on a descriptor of the feed's own.
    ///
    /// # Cancel safety
    ///
    /// The descriptor is the feed's: dropped, it is closed.
    #[cfg(target_os = "linux")]
    async fn changes(&self, prefix: &NamePrefix) -> Result<leasehold_core::Changes> {
        crate::notify::feed(self.dir(), prefix.clone())
            .map_err(|e| crate::directory::io_error("watching the lock directory", e))
    }

    /// Lists from one pass over the directory per page.
    ///
    /// # Cancel safety
    ///
    /// It removes only records of dead processes and expired notes (records kept beside a
    /// lock); dropping it changes nothing else.
    async fn list(
        &self,
        prefix: &NamePrefix,
        cursor: Option<&ListCursor>,
        page: usize,
    ) -> Result<Listing> {
        let after = cursor.map(ListCursor::as_str);
        let records = self.scan(|name| {
            name.starts_with(prefix.as_str()) && after.is_none_or(|after| name > after)
        })?;
        let mut by_name: BTreeMap<LockName, Vec<(OwnerId, Record)>> = BTreeMap::new();
        for (name, owner, record) in records {
            by_name.entry(name).or_default().push((owner, record));
        }
        let page = page.max(1);
        let next = (by_name.len() > page)
            .then(|| by_name.keys().nth(page - 1))
            .flatten()
            .map(|last| ListCursor::new(last.as_str()));
        let locks = by_name
            .into_iter()
            .take(page)
            .map(|(name, records)| (name, state_of(records)))
            .collect();
        Ok(Listing::new(locks, next))
    }
}

impl FileBackend {
    /// Enters `req`'s acquisition as `status`, then writes its record if `write`.
    /// An acquisition goes in before its record is written: `inspect` deletes a record of
    /// this process whose owner is not in there. On error it is taken out again, and
    /// dropping its `files` gives back their kernel locks.
    fn enter(&self, req: &Request, status: Status, files: Files, write: bool) -> Result<()> {
        let acquisition = Acquisition {
            name: req.name.clone(),
            mode: req.mode,
            status,
            files,
        };
        acquisitions().insert(req.owner.clone(), acquisition);
        if write && let Err(error) = self.write_record(req, status) {
            let acquisition = acquisitions().remove(&req.owner);
            drop(acquisition);
            return Err(error);
        }
        Ok(())
    }
}

/// Holders (by token) and waiters of one name, from its records.
/// A holder has held since its record was written, as the local clock says.
fn state_of(records: Vec<(OwnerId, Record)>) -> LockState {
    let mut state = LockState::default();
    for (owner, record) in records {
        match record.status {
            Status::Held(token) => state.holders.push(
                Holder::new(owner, record.mode, token)
                    .with_value(record.value.map(Into::into))
                    .with_held(
                        record
                            .written
                            .and_then(|at| SystemTime::now().duration_since(at).ok()),
                    ),
            ),
            Status::Waiting => state.waiters.push(Waiter::new(owner, record.mode)),
        }
    }
    state.holders.sort_by_key(|holder| holder.token);
    state
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use std::path::Path;

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

    /// The descriptors this process has open on `dir` and the files under it.
    /// Only those: the other tests of this binary run beside this one, in this process.
    fn open_under(dir: &Path) -> usize {
        let dir = dir.canonicalize().unwrap();
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
            .filter(|target| target.starts_with(&dir))
            .count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn per_name_state_returns_to_its_baseline_after_100_000_names() {
        let dir = scratch_dir();
        let backend = FileBackend::open(dir.path()).unwrap();
        let client = Client::new(backend.clone());
        let rival = Client::new(FileBackend::open(dir.path()).unwrap());
        // Once, so that the notifier's reader and the runtime's own descriptors exist.
        let warm_up = client.mutex("warm-up").unwrap().lock().await.unwrap();
        warm_up.release().await.unwrap();
        client.settle().await;
        let descriptors = open_under(dir.path());
        for i in 0..100_000 {
            let name = format!("order-{i}");
            let guard = client.mutex(&name).unwrap().lock().await.unwrap();
            if i == 0 {
                // A held lock keeps its file open: the count would see one left behind.
                assert!(open_under(dir.path()) > descriptors);
            }
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
        assert_eq!(open_under(dir.path()), descriptors);
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
