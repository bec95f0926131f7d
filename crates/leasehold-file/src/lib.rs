//! leasehold's local embedded backend: cross-process locks on one host through file locks.
//!
//! The crate, one concern per file:
//!
//! - `lib.rs`: this map, how it works in brief, the exports.
//! - `directory.rs`: [`FileBackend`] on its lock directory, and opening the files there.
//! - `acquisitions.rs`: this process's acquisitions by owner: their states and descriptors.
//! - `lock_files.rs`: `N#lock` and `N#gate`, `flock` files deleted by their last holder.
//! - `semaphore.rs`: `N#sem`, one descriptor per name whose permits are byte-range locks.
//! - `ofd.rs`: byte-range write locks owned by an open file description (the permits).
//! - `tokens.rs`: `#tokens`, the fencing counters of all names.
//! - `records.rs`: `N#who-OWNER`, a holder's or waiter's record for `inspect`.
//! - `notes.rs`: `N#notes/KEY`, records kept beside a lock (job records) until they expire.
//! - `notify.rs`: push wake-ups for waiters: one inotify watch on the lock directory.
//! - `backend.rs`: the [`Backend`](leasehold_core::Backend) implementation.
//!
//! The kernel releases a file lock when the process holding it dies, however it dies, so
//! grants here never expire and need no renewal: a holder keeps its lock until it releases
//! it or exits. That makes this backend a good default for one machine (cron jobs, CLI
//! tools, tests) and a poor one for anything that spans machines: use a server backend for
//! that (and note that NFS file locking is not reliable enough to build on).
//!
//! How it works, for a lock name `N` (`#` never occurs in a lock name, so no name's files
//! collide with another's):
//!
//! - **Exclusive and shared** holders take an exclusive or shared `flock` of `N#lock`; a
//!   waiting writer holds `N#gate`, and new readers queue behind it.
//! - **Permit** `K` of a semaphore is a write lock on byte `K` of `N#sem`.
//! - **Tokens** come from `#tokens`, 1024 fsynced counters shared by hash of the name.
//! - **Records** `N#who-OWNER` (pid, mode, token, value) are what `inspect` reads.
//! - **Notes** `N#notes/KEY` are the records kept beside a lock (`put_record`): written
//!   only while this process holds the writer's grant, kept until their expiry.
//! - **Clean-up**: the last holder of a lock file deletes it, so the directory holds files
//!   only for names in use, plus the counters and the notes not yet expired.
//!
//! Guarantees:
//!
//! - Mutual exclusion between all processes (and all clients in one process) using the same
//!   directory on one host, for as long as nobody deletes the lock files by hand.
//! - Fencing tokens strictly increase per name for as long as the `#tokens` file survives:
//!   across process restarts always; across reboots only if the directory is on persistent
//!   storage (the default directory under `$XDG_RUNTIME_DIR` is usually a tmpfs, reset at
//!   boot — point `file:///var/lib/...` at persistent storage if a protected resource
//!   outlives reboots).
//! - Waiters are woken by inotify when a holder releases or dies; no polling on Linux.
//! - No FIFO queue: waiters race for a released lock. Readers do queue behind a waiting
//!   writer, so writers are not starved.
//!
//! See `docs/backends/file.md`.

mod acquisitions;
mod backend;
mod directory;
mod lock_files;
mod notes;
mod notify;
#[cfg(target_os = "linux")]
mod ofd;
mod records;
mod semaphore;
mod tokens;

pub use acquisitions::held_descriptor;
pub use directory::{FileBackend, default_dir};
