//! Byte-range write locks owned by an open file description (Linux `F_OFD_SETLK`).
//!
//! Unlike classic POSIX record locks they belong to the description, not the process: two
//! descriptions conflict even within one process, closing another descriptor of the file
//! does not drop them, a child that inherits the descriptor shares them, and the kernel
//! drops them when the last descriptor of the description is closed (the holder exits or
//! dies). Locks of one description never conflict with each other; adjacent ranges merge.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// A range of bytes: `len` 0 means "to the end of any file".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) start: u64,
    pub(crate) len: u64,
}

impl Range {
    pub(crate) fn new(start: u64, len: u64) -> Self {
        Self { start, len }
    }

    /// The first byte after the range (`u64::MAX` for an open end).
    pub(crate) fn end(self) -> u64 {
        if self.len == 0 {
            u64::MAX
        } else {
            self.start.saturating_add(self.len)
        }
    }
}

fn request(kind: libc::c_short, range: Range) -> io::Result<libc::flock> {
    let out_of_range = || io::Error::new(io::ErrorKind::InvalidInput, "lock range out of range");
    // SAFETY: `flock` is a plain C struct of integers; all zeroes is a valid value (and the
    // zero `l_pid` that OFD requests require).
    #[allow(unsafe_code)]
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = range.start.try_into().map_err(|_| out_of_range())?;
    lock.l_len = range.len.try_into().map_err(|_| out_of_range())?;
    Ok(lock)
}

fn fcntl(fd: impl AsFd, command: libc::c_int, lock: &mut libc::flock) -> io::Result<()> {
    let fd = fd.as_fd();
    // SAFETY: `fd` is a borrowed, open descriptor for the whole call, and `lock` is a valid,
    // exclusively borrowed `flock` that the kernel reads (and, for F_OFD_GETLK, writes).
    #[allow(unsafe_code)]
    let result = unsafe { libc::fcntl(fd.as_raw_fd(), command, lock as *mut libc::flock) };
    if result == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Takes a write lock on `range` without waiting.
/// `Ok(false)` if another description holds part of it.
pub(crate) fn try_lock(fd: impl AsFd, range: Range) -> io::Result<bool> {
    let mut lock = request(libc::F_WRLCK as libc::c_short, range)?;
    match fcntl(fd, libc::F_OFD_SETLK, &mut lock) {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Drops this description's locks on `range`.
pub(crate) fn unlock(fd: impl AsFd, range: Range) -> io::Result<()> {
    let mut lock = request(libc::F_UNLCK as libc::c_short, range)?;
    fcntl(fd, libc::F_OFD_SETLK, &mut lock)
}

/// A lock of another description that overlaps `range`, if any.
pub(crate) fn blocker(fd: impl AsFd, range: Range) -> io::Result<Option<Range>> {
    let mut lock = request(libc::F_WRLCK as libc::c_short, range)?;
    fcntl(fd, libc::F_OFD_GETLK, &mut lock)?;
    if lock.l_type == libc::F_UNLCK as libc::c_short {
        return Ok(None);
    }
    let field = |v: libc::off_t| {
        u64::try_from(v).map_err(|_| io::Error::other("the kernel reported a negative lock range"))
    };
    Ok(Some(Range::new(field(lock.l_start)?, field(lock.l_len)?)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use super::*;

    #[test]
    fn descriptions_conflict_and_blockers_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let a = std::fs::File::create(&path).unwrap();
        let b = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert!(try_lock(&a, Range::new(0, 1)).unwrap());
        assert!(try_lock(&a, Range::new(1, 1)).unwrap());
        assert!(!try_lock(&b, Range::new(1, 1)).unwrap());
        // a's two bytes merged into one lock.
        assert_eq!(
            blocker(&b, Range::new(1, 1)).unwrap(),
            Some(Range::new(0, 2))
        );
        assert_eq!(blocker(&a, Range::new(1, 1)).unwrap(), None);
        assert!(try_lock(&b, Range::new(2, 1)).unwrap());
        unlock(&a, Range::new(0, 1)).unwrap();
        assert!(try_lock(&b, Range::new(0, 1)).unwrap());
        drop(a);
        assert!(try_lock(&b, Range::new(0, 0)).unwrap());
    }
}
