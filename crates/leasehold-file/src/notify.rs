//! Push wake-ups for waiters: one inotify watch on the lock directory.
//!
//! A holder's lock file descriptor is opened for writing, so closing it — on release, or by
//! the kernel when the holder dies — raises `IN_CLOSE_WRITE` for that file; a release that
//! deletes the lock file raises `IN_DELETE`, and a released permit touches the semaphore
//! file (`IN_ATTRIB`). Holder records being written or deleted raise events too, which is
//! what election observers need. Each event wakes every waiter of the lock name it belongs
//! to; a waiter takes its ticket *before* it tries the lock and sleeps until woken, so a
//! release between the try and the sleep is never missed.
//!
//! A name has state only while a [`Ticket`] of it exists (a waiter's or an inspector's wait
//! hint, on the backend's wake-up board, `leasehold_core::support::wakeups`): events for
//! other names are dropped, and a process that locks millions of distinct names keeps
//! state only for those it is waiting on.
//!
//! Waiters keep their own descriptors open between tries, so a failed try of a waiter raises
//! nothing and waking does not cascade.

use std::path::Path;
use std::time::Duration;

use leasehold_core::support::wakeups::{Board, Ticket};

/// The wake-up board of a lock directory, woken by its file events.
#[derive(Debug)]
pub(crate) struct Notifier {
    board: Board,
    #[cfg(target_os = "linux")]
    reader: linux::Reader,
}

impl Notifier {
    pub(crate) fn new(dir: &Path) -> std::io::Result<Self> {
        let board = Board::new();
        Ok(Self {
            #[cfg(target_os = "linux")]
            reader: linux::Reader::new(dir, board.clone())?,
            board,
        })
    }

    /// How many names have state now.
    #[cfg(test)]
    pub(crate) fn tracked_names(&self) -> usize {
        self.board.len()
    }

    /// A ticket of `name`, watched for as long as it lives. Take it before trying the lock.
    pub(crate) fn ticket(&self, name: &str) -> Ticket {
        #[cfg(target_os = "linux")]
        self.reader.ensure_running();
        self.board.ticket(name, None)
    }

    /// Returns when `seen`'s name changed since it was taken, or after `max`.
    /// Without a ticket it returns at once.
    pub(crate) async fn wait(&self, seen: Option<&Ticket>, max: Duration) {
        #[cfg(target_os = "linux")]
        let max = if self.reader.ensure_running() {
            max
        } else {
            // No inotify: fall back to a short poll.
            max.min(Duration::from_millis(50))
        };
        #[cfg(not(target_os = "linux"))]
        let max = max.min(Duration::from_millis(50));
        if let Some(seen) = seen {
            seen.wait(max).await;
        }
    }
}

#[cfg(target_os = "linux")]
pub(crate) use linux::feed;

#[cfg(target_os = "linux")]
mod linux {
    use std::mem::MaybeUninit;
    use std::os::fd::OwnedFd;
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    use leasehold_core::support::wakeups::{Board, EVERYONE};
    use leasehold_core::{Changes, LockName, NamePrefix};
    use rustix::fs::inotify;
    use rustix::io::Errno;
    use tokio::io::unix::AsyncFd;
    use tokio::task::JoinHandle;

    /// The inotify descriptor and the task reading it.
    /// The task is started inside a runtime, and restarted if that runtime went away.
    #[derive(Debug)]
    pub(super) struct Reader {
        fd: Option<Arc<OwnedFd>>,
        board: Board,
        task: Mutex<Option<JoinHandle<()>>>,
    }

    impl Reader {
        pub(super) fn new(dir: &Path, board: Board) -> std::io::Result<Self> {
            let watch = || -> rustix::io::Result<OwnedFd> {
                let fd =
                    inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC)?;
                inotify::add_watch(
                    &fd,
                    dir,
                    inotify::WatchFlags::CLOSE_WRITE
                        | inotify::WatchFlags::ATTRIB
                        | inotify::WatchFlags::DELETE
                        | inotify::WatchFlags::MOVED_TO,
                )?;
                Ok(fd)
            };
            // Without inotify (limits reached, exotic file system) waiting degrades to
            // polling rather than failing.
            let fd = match watch() {
                Ok(fd) => Some(Arc::new(fd)),
                Err(error) => {
                    tracing::warn!(%error, dir = %dir.display(), "inotify unavailable; waiters will poll");
                    None
                }
            };
            Ok(Self {
                fd,
                board,
                task: Mutex::new(None),
            })
        }

        /// Starts the reading task if it is not running; returns whether events flow.
        pub(super) fn ensure_running(&self) -> bool {
            let Some(fd) = &self.fd else {
                return false;
            };
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return false;
            };
            let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
            if task.as_ref().is_some_and(|t| !t.is_finished()) {
                return true;
            }
            // SAFETY: the `AsyncFd` owns a clone of the `Arc<OwnedFd>`, so the descriptor
            // stays open and unchanged for as long as it does.
            #[allow(unsafe_code)]
            let Ok(async_fd) = (unsafe { AsyncFd::register(fd.clone()) }) else {
                return false;
            };
            let board = self.board.clone();
            *task = Some(runtime.spawn(each_batch(async_fd, move |names, _| {
                // Names nobody waits on have no state: their events are dropped.
                for name in names {
                    board.wake(name, [EVERYONE]);
                }
            })));
            true
        }
    }

    /// Reads `fd`'s events until it fails, handing each batch's lock names to `touched`.
    /// A file is `NAME#kind`: its events belong to the lock `NAME`.
    /// `overflowed` says the kernel's queue overflowed before the batch: events were lost.
    async fn each_batch(async_fd: AsyncFd<Arc<OwnedFd>>, mut touched: impl FnMut(&[String], bool)) {
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        loop {
            let Ok(mut ready) = async_fd.readable().await else {
                return;
            };
            let mut names: Vec<String> = Vec::new();
            let mut overflowed = false;
            let mut reader = inotify::Reader::new(async_fd.get_ref(), &mut buf);
            loop {
                match reader.next() {
                    Ok(event) => {
                        overflowed |= event.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW);
                        if let Some(file) = event.file_name().and_then(|f| f.to_str().ok())
                            && let Some((name, _)) = file.split_once('#')
                            && !name.is_empty()
                            && names.last().map(String::as_str) != Some(name)
                        {
                            names.push(name.to_owned());
                        }
                    }
                    Err(Errno::AGAIN) => {
                        ready.clear_ready();
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "inotify read failed");
                        return;
                    }
                }
            }
            touched(&names, overflowed);
        }
    }

    /// A change feed of `dir`, on an inotify descriptor of its own.
    /// The descriptor is closed when the watcher drops the feed. Every file event names its
    /// lock; the kernel's event queue overflowing is a resync.
    pub(crate) fn feed(dir: &Path, prefix: NamePrefix) -> std::io::Result<Changes> {
        let fd = inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC)?;
        inotify::add_watch(
            &fd,
            dir,
            inotify::WatchFlags::CLOSE_WRITE
                | inotify::WatchFlags::ATTRIB
                | inotify::WatchFlags::CREATE
                | inotify::WatchFlags::DELETE
                | inotify::WatchFlags::MOVED_FROM
                | inotify::WatchFlags::MOVED_TO,
        )?;
        // SAFETY: the `AsyncFd` owns the only `Arc` of the descriptor, so it stays open
        // and unchanged for as long as the `AsyncFd` lives.
        #[allow(unsafe_code)]
        let async_fd = unsafe { AsyncFd::register(Arc::new(fd))? };
        let (sender, changes) = Changes::channel();
        tokio::spawn(async move {
            let notices = sender.clone();
            let events = each_batch(async_fd, move |names, overflowed| {
                if overflowed {
                    notices.resync();
                }
                for name in names {
                    match LockName::new(name) {
                        Ok(name) if prefix.matches(&name) => notices.changed(name),
                        _ => {}
                    }
                }
            });
            tokio::select! {
                () = events => {}
                () = sender.closed() => {}
            }
        });
        Ok(changes)
    }

    impl Drop for Reader {
        fn drop(&mut self) {
            if let Some(task) = self.task.get_mut().unwrap_or_else(|e| e.into_inner()) {
                task.abort();
            }
        }
    }
}
