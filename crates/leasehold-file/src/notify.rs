//! Push wake-ups for waiters: one inotify watch on the lock directory.
//!
//! A holder's lock file descriptor is opened for writing, so closing it — on release, or by
//! the kernel when the holder dies — raises `IN_CLOSE_WRITE` for that file. Holder records
//! being written or deleted raise events too, which is what election observers need. Each
//! event bumps a version counter of the lock name it belongs to; a waiter reads the counter
//! *before* it tries the lock and sleeps until the counter moves, so a release between the
//! try and the sleep is never missed.
//!
//! Waiters keep their own descriptors open between tries, so a failed try of a waiter raises
//! nothing and waking does not cascade.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

/// Per-name version counters, bumped by file events in the lock directory.
#[derive(Debug)]
pub(crate) struct Notifier {
    names: Arc<Mutex<HashMap<String, watch::Sender<u64>>>>,
    #[cfg(target_os = "linux")]
    reader: linux::Reader,
}

impl Notifier {
    pub(crate) fn new(dir: &Path) -> std::io::Result<Self> {
        let names = Arc::new(Mutex::new(HashMap::new()));
        Ok(Self {
            #[cfg(target_os = "linux")]
            reader: linux::Reader::new(dir, names.clone())?,
            names,
        })
    }

    fn sender(&self, name: &str) -> watch::Sender<u64> {
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names
            .entry(name.to_owned())
            .or_insert_with(|| watch::Sender::new(0))
            .clone()
    }

    /// The current version of `name`, watched from now on. Read it before trying the lock.
    pub(crate) fn version(&self, name: &str) -> u64 {
        #[cfg(target_os = "linux")]
        self.reader.ensure_running();
        *self.sender(name).borrow()
    }

    /// Returns when the version of `name` differs from `seen`, or after `max`.
    pub(crate) async fn wait(&self, name: &str, seen: Option<u64>, max: Duration) {
        #[cfg(target_os = "linux")]
        let max = if self.reader.ensure_running() {
            max
        } else {
            // No inotify: fall back to a short poll.
            max.min(Duration::from_millis(50))
        };
        #[cfg(not(target_os = "linux"))]
        let max = max.min(Duration::from_millis(50));
        let mut rx = self.sender(name).subscribe();
        if seen != Some(*rx.borrow_and_update()) {
            return;
        }
        let _ = tokio::time::timeout(max, rx.changed()).await;
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::HashMap;
    use std::mem::MaybeUninit;
    use std::os::fd::{AsRawFd, OwnedFd, RawFd};
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    use rustix::fs::inotify;
    use rustix::io::Errno;
    use tokio::io::unix::AsyncFd;
    use tokio::sync::watch;
    use tokio::task::JoinHandle;

    type Names = Arc<Mutex<HashMap<String, watch::Sender<u64>>>>;

    /// The inotify descriptor and the task reading it (started inside a runtime, and
    /// restarted if that runtime went away).
    #[derive(Debug)]
    pub(super) struct Reader {
        fd: Option<Arc<OwnedFd>>,
        names: Names,
        task: Mutex<Option<JoinHandle<()>>>,
    }

    struct Fd(Arc<OwnedFd>);

    impl AsRawFd for Fd {
        fn as_raw_fd(&self) -> RawFd {
            self.0.as_raw_fd()
        }
    }

    impl Reader {
        pub(super) fn new(dir: &Path, names: Names) -> std::io::Result<Self> {
            let watch = || -> rustix::io::Result<OwnedFd> {
                let fd =
                    inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC)?;
                inotify::add_watch(
                    &fd,
                    dir,
                    inotify::WatchFlags::CLOSE_WRITE
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
                names,
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
            // SAFETY: `Fd` holds a clone of the `Arc<OwnedFd>`, so the descriptor stays open
            // and unchanged for as long as the `AsyncFd` owns it.
            #[allow(unsafe_code)]
            let Ok(async_fd) = (unsafe { AsyncFd::register(Fd(fd.clone())) }) else {
                return false;
            };
            let names = Arc::downgrade(&self.names);
            *task = Some(runtime.spawn(async move {
                let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
                loop {
                    let Ok(mut ready) = async_fd.readable().await else {
                        return;
                    };
                    let mut touched = Vec::new();
                    let mut reader = inotify::Reader::new(&*async_fd.get_ref().0, &mut buf);
                    loop {
                        match reader.next() {
                            Ok(event) => {
                                if let Some(file) = event.file_name().and_then(|f| f.to_str().ok())
                                    && let Some((name, kind)) = file.split_once('#')
                                    && kind != "token"
                                {
                                    touched.push(name.to_owned());
                                }
                            }
                            Err(Errno::AGAIN) => {
                                ready.clear_ready();
                                break;
                            }
                            Err(error) => {
                                tracing::warn!(%error, "inotify read failed; waiters will poll");
                                return;
                            }
                        }
                    }
                    let Some(names) = names.upgrade() else {
                        return;
                    };
                    let names = names.lock().unwrap_or_else(|e| e.into_inner());
                    for name in touched {
                        if let Some(version) = names.get(&name) {
                            version.send_modify(|v| *v += 1);
                        }
                    }
                }
            }));
            true
        }
    }

    impl Drop for Reader {
        fn drop(&mut self) {
            if let Some(task) = self.task.get_mut().unwrap_or_else(|e| e.into_inner()) {
                task.abort();
            }
        }
    }
}
