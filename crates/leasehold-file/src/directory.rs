//! The backend value on its lock directory, and opening and checking the files there.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use leasehold_core::{Error, LockName, Result};

use crate::notify::Notifier;
use crate::semaphore::Semaphores;

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
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) dir: PathBuf,
    pub(crate) notifier: Notifier,
    pub(crate) semaphores: Semaphores,
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
                semaphores: Semaphores::default(),
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

    /// The path of `name`'s file of `kind` (`lock`, `gate`, `sem`, `who-OWNER`, `notes`).
    pub(crate) fn path(&self, name: &LockName, kind: &str) -> PathBuf {
        self.inner.dir.join(format!("{name}#{kind}"))
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

/// Opens `path` for reading and writing, creating it (mode 0600) if missing.
pub(crate) fn open_rw(path: &Path) -> Result<File> {
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
pub(crate) fn is_linked(file: &File, path: &Path) -> Result<bool> {
    let failed = |e| io_error(&format!("checking {}", path.display()), e);
    let open = file.metadata().map_err(failed)?;
    match std::fs::metadata(path) {
        Ok(linked) => Ok(open.dev() == linked.dev() && open.ino() == linked.ino()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(failed(e)),
    }
}

/// The value in `slot`, opened by `open` if there is none yet.
pub(crate) fn reuse<T>(slot: &mut Option<T>, open: impl FnOnce() -> Result<T>) -> Result<&mut T> {
    let value = match slot.take() {
        Some(value) => value,
        None => open()?,
    };
    Ok(slot.insert(value))
}

/// A failed file operation as a leasehold error: `what` failed, and why.
pub(crate) fn io_error(what: &str, error: std::io::Error) -> Error {
    Error::Backend {
        message: format!("{what}: {error}"),
        retryable: false,
        source: Some(Arc::new(error)),
    }
}
