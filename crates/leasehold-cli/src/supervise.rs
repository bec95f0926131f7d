//! The supervisor: a small process between `leasehold run` and the command.
//! With it the command never outlives the lock, even when `leasehold run` itself is killed,
//! frozen or starved.
//!
//! `leasehold run` holds the lock and starts the supervisor (its own binary, hidden
//! subcommand `__supervise`), handing it one end of a socket pair. Told to start, the
//! supervisor starts the command in a process group of its own, reports the command's pid
//! over the socket, and then watches four things:
//!
//! - the lease's deadline, which `leasehold run` sends with the start and again after
//!   every renewal (or keep-alive of the session the lock lives by). When the deadline is
//!   `--grace` away and no later one has come, the lock is lost as far as the command is
//!   concerned: the group gets SIGTERM, and SIGKILL at the deadline. A renewal that
//!   arrives after that changes nothing. This does not depend on `leasehold run` being
//!   scheduled at all: frozen (SIGSTOP) or starved, it simply sends no later deadline. A
//!   grant that does not expire (the file backend) has no deadline;
//! - the command and the rest of its process group: when the command exits, members of the
//!   group it left behind are stopped too (SIGTERM, then SIGKILL after `--grace` or at the
//!   deadline, whichever comes first), and the supervisor exits with the command's code
//!   once the group is empty;
//! - stop orders from `leasehold run` (a signal number): stop the group with that signal,
//!   then SIGKILL after `--grace` or at the deadline, whichever comes first;
//! - the end of the socket: `leasehold run` is gone, however it died (the kernel closes its
//!   end), so nobody holds or renews the lock for the command any more. The group is stopped
//!   at once with SIGKILL — or, when the command holds the lock itself through an inherited
//!   descriptor (the file backend), with SIGTERM and `--orphan-grace` first, since the lock
//!   then lasts exactly as long as the group.
//!
//! # The protocol
//!
//! Frames of 9 bytes, both ways: a kind byte and a little-endian `u64`. A deadline is in
//! nanoseconds of `CLOCK_BOOTTIME` ([`SystemClock`], the clock lease deadlines are kept on:
//! system-wide, so both processes read the same one, and counting suspend), `u64::MAX` for
//! none.
//!
//! | kind | from | value | meaning |
//! |---|---|---|---|
//! | `S` | run | deadline | start the command — unless the deadline is `--grace` away or less: then exit 80 without starting it |
//! | `D` | run | deadline | a renewal moved the deadline |
//! | `K` | run | signal number | stop the group with that signal |
//! | `P` | supervisor | pid | the command started; its pid is its process group's |
//! | `T` | supervisor | deadline | no renewal came by `--grace` before the deadline: the group got SIGTERM, and gets SIGKILL at the deadline |
//!
//! The end of the socket means that the other process is gone; a frame that does not
//! decode is taken as the end.
//!
//! The end of a socket is used rather than `PR_SET_PDEATHSIG`: it fires however and
//! whenever the parent dies (also before the supervisor got to set anything up), does not
//! depend on which of the parent's threads started it, and carries the parent's orders
//! too. The supervisor is a child subreaper on Linux, so the group's processes whose parents
//! die are reaped here, and the group's end is seen without polling.
//!
//! The supervisor ignores SIGINT, SIGTERM and SIGHUP (they reach it from the terminal with
//! `leasehold run`, which passes them on through the socket); the command starts with the
//! default dispositions.

use std::ffi::OsString;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use leasehold::clock::{Clock, Instant, SystemClock};
use rustix::process::{Pid, Signal, WaitOptions, kill_process_group, test_kill_process_group};
use tokio::net::UnixStream;
use tokio::signal::unix::{SignalKind, signal};

use crate::exit;

/// What the supervisor was started with.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// The supervisor's end of the socket pair (a descriptor number it inherited).
    pub channel: RawFd,
    /// How long before the deadline SIGTERM comes.
    /// It is also the time between SIGTERM and SIGKILL when ordered to stop, or when the
    /// command left members of its group behind.
    pub grace: Duration,
    /// Between SIGTERM and SIGKILL when `leasehold run` is gone; zero: SIGKILL at once.
    pub orphan_grace: Duration,
    /// The command and its arguments.
    pub command: Vec<OsString>,
}

/// Runs the supervisor; returns the exit code to leave with.
/// That is the command's own, 128 + N if it was killed by signal N, 126/127 if it could not
/// be started, 80 if the lock ran out before it could start.
pub async fn supervise(spec: Supervision) -> u8 {
    // Taken first, so that an early return still closes it.
    let mut channel = match take_channel(spec.channel) {
        Ok(channel) => Channel::new(channel),
        Err(error) => {
            eprintln!("leasehold: supervisor: {error}");
            return exit::BACKEND;
        }
    };
    // Registered before anything else: from now on these only raise a flag here.
    let (Ok(_int), Ok(_term), Ok(_hup), Ok(mut children)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::child()),
    ) else {
        eprintln!("leasehold: supervisor: cannot handle signals");
        return exit::BACKEND;
    };
    #[cfg(target_os = "linux")]
    let _ = rustix::process::set_child_subreaper(Some(rustix::process::getpid()));

    let Some(program) = spec.command.first() else {
        return exit::USAGE;
    };
    let mut deadline = match channel.next().await {
        Some(Frame::Start(deadline)) => deadline,
        // `leasehold run` is gone before it ordered the start.
        None => return exit::BACKEND,
        Some(other) => {
            eprintln!("leasehold: supervisor: {other:?} before the start");
            return exit::BACKEND;
        }
    };
    // The last moment the lock is known to be held, with the grace still ahead.
    if deadline.is_some_and(|d| term_at(d, spec.grace) <= SystemClock.now()) {
        return exit::LOST;
    }
    // std, not tokio: the supervisor reaps every child itself (see `reap`).
    let spawned = std::process::Command::new(program)
        .args(&spec.command[1..])
        .process_group(0)
        .spawn();
    let child = match spawned {
        Ok(child) => child,
        Err(error) => {
            eprintln!(
                "leasehold: cannot run {}: {error}",
                program.to_string_lossy()
            );
            return if error.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
        }
    };
    let Some(group) = Pid::from_raw(child.id() as i32) else {
        return exit::BACKEND;
    };
    drop(child);
    channel.send(Frame::Started(group));

    let mut status: Option<u8> = None;
    // Set once the group is being stopped: SIGKILL at this instant.
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    loop {
        reap(group, &mut status);
        let alive = test_kill_process_group(group).is_ok();
        if status.is_some() && !alive {
            break;
        }
        let now = SystemClock.now();
        if kill_at.is_none() {
            if status.is_some() {
                // The command is done; what it left behind in its group is stopped too.
                let at = now.saturating_add(spec.grace);
                kill_at = Some(stop(group, Signal::TERM, at, deadline));
            } else if let Some(d) = deadline
                && now >= term_at(d, spec.grace)
            {
                // No renewal in time: for the command, the lock is lost.
                kill_at = Some(stop(group, Signal::TERM, d, deadline));
                channel.send(Frame::Stopping(d));
            }
        }
        if !killed && kill_at.is_some_and(|at| at <= now) {
            let _ = kill_process_group(group, Signal::KILL);
            killed = true;
        }
        // While the group is being stopped: SIGKILL when its time comes, and look again now
        // and then (a member whose parent left the group dies unseen here). Before: SIGTERM
        // when the deadline is `grace` away.
        let soon = now.saturating_add(Duration::from_millis(100));
        let wake = match kill_at {
            Some(at) if !killed => Some(at.min(soon)),
            Some(_) => Some(soon),
            None => deadline.map(|d| term_at(d, spec.grace)),
        };
        tokio::select! {
            _ = children.recv() => {}
            frame = channel.next(), if channel.is_open() => {
                let now = SystemClock.now();
                match frame {
                    // Once the group is being stopped, a later deadline changes nothing.
                    Some(Frame::Deadline(moved)) if kill_at.is_none() => deadline = moved,
                    Some(Frame::Stop(signal)) => {
                        let signal = Signal::from_named_raw(signal).unwrap_or(Signal::TERM);
                        let at = if signal == Signal::KILL {
                            now
                        } else {
                            now.saturating_add(spec.grace)
                        };
                        let at = stop(group, signal, at, deadline);
                        kill_at = Some(kill_at.map_or(at, |earlier| earlier.min(at)));
                    }
                    Some(_) => {}
                    // `leasehold run` is gone: nobody holds or renews the lock for us.
                    None => {
                        let at = if spec.orphan_grace.is_zero() {
                            stop(group, Signal::KILL, now, deadline)
                        } else {
                            let at = now.saturating_add(spec.orphan_grace);
                            stop(group, Signal::TERM, at, deadline)
                        };
                        kill_at = Some(kill_at.map_or(at, |earlier| earlier.min(at)));
                    }
                }
            }
            () = SystemClock.sleep_until(wake.unwrap_or(now)), if wake.is_some() => {}
        }
    }
    channel.flush_now();
    status.unwrap_or(exit::BACKEND)
}

/// When SIGTERM is due for a lease ending at `deadline`: `grace` before it.
fn term_at(deadline: Instant, grace: Duration) -> Instant {
    deadline
        .checked_sub(grace)
        .unwrap_or(Instant::from_origin(Duration::ZERO))
}

/// Takes ownership of the inherited socket and keeps it from the command.
fn take_channel(fd: RawFd) -> std::io::Result<UnixStream> {
    if fd < 3 {
        return Err(std::io::Error::other(format!(
            "{fd} is not a channel descriptor"
        )));
    }
    // SAFETY: `leasehold run` started this process with `fd` open, for this process to own,
    // and nothing else here uses that number.
    #[allow(unsafe_code)]
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)?;
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

/// Reaps every child that has exited, noting the command's exit code.
/// Those are the command and, as a subreaper, the orphans of its group.
fn reap(command: Pid, status: &mut Option<u8>) {
    while let Ok(Some((pid, exited))) = rustix::process::wait(WaitOptions::NOHANG) {
        if pid == command {
            *status = Some(match (exited.exit_status(), exited.terminating_signal()) {
                (Some(code), _) => code as u8,
                (None, Some(signal)) => exit::signal(signal),
                (None, None) => exit::BACKEND,
            });
        }
    }
}

/// Sends `signal` to the group; returns when to follow with SIGKILL.
/// That is at `at`, or at the deadline if that comes first.
fn stop(group: Pid, signal: Signal, at: Instant, deadline: Option<Instant>) -> Instant {
    let _ = kill_process_group(group, signal);
    deadline.map_or(at, |d| d.min(at))
}

/// One message of the protocol (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// `S`: start the command; the lease's deadline (`None`: it does not expire).
    Start(Option<Instant>),
    /// `D`: the lease's deadline moved.
    Deadline(Option<Instant>),
    /// `K`: stop the command's group with this signal.
    Stop(i32),
    /// `P`: the command started, with this pid (and process group).
    Started(Pid),
    /// `T`: the deadline is `--grace` away without a renewal.
    /// The group got SIGTERM and gets SIGKILL at this deadline.
    Stopping(Instant),
}

/// The length of every frame.
const FRAME: usize = 9;
/// The value that stands for "no deadline".
const NO_DEADLINE: u64 = u64::MAX;

impl Frame {
    fn encode(self) -> [u8; FRAME] {
        let (kind, value) = match self {
            Frame::Start(deadline) => (b'S', deadline_value(deadline)),
            Frame::Deadline(deadline) => (b'D', deadline_value(deadline)),
            Frame::Stop(signal) => (b'K', u64::from(signal.unsigned_abs())),
            Frame::Started(pid) => (b'P', u64::from(pid.as_raw_nonzero().get().unsigned_abs())),
            Frame::Stopping(deadline) => (b'T', deadline_value(Some(deadline))),
        };
        let mut frame = [0; FRAME];
        frame[0] = kind;
        frame[1..].copy_from_slice(&value.to_le_bytes());
        frame
    }

    fn decode(frame: [u8; FRAME]) -> Option<Frame> {
        let mut value = [0; 8];
        value.copy_from_slice(&frame[1..]);
        let value = u64::from_le_bytes(value);
        let deadline =
            (value != NO_DEADLINE).then(|| Instant::from_origin(Duration::from_nanos(value)));
        Some(match frame[0] {
            b'S' => Frame::Start(deadline),
            b'D' => Frame::Deadline(deadline),
            b'K' => Frame::Stop(i32::try_from(value).ok()?),
            b'P' => Frame::Started(Pid::from_raw(i32::try_from(value).ok()?)?),
            b'T' => Frame::Stopping(deadline?),
            _ => return None,
        })
    }
}

/// A deadline as a frame's value: nanoseconds of its clock.
/// It is saturated, short of [`NO_DEADLINE`], some 584 years after boot.
fn deadline_value(deadline: Option<Instant>) -> u64 {
    deadline.map_or(NO_DEADLINE, |d| {
        u64::try_from(d.since_origin().as_nanos())
            .map_or(NO_DEADLINE - 1, |n| n.min(NO_DEADLINE - 1))
    })
}

/// One end of the socket between `leasehold run` and the supervisor.
/// It sends and receives [`Frame`]s.
#[derive(Debug)]
pub struct Channel {
    stream: UnixStream,
    /// Received bytes not yet made into a frame.
    inbox: Vec<u8>,
    /// Frames not yet sent.
    /// They are written while [`next`](Channel::next) runs, never blocking the caller on a
    /// peer that does not read.
    outbox: Vec<u8>,
    /// The other end is gone, or sent something that is not a frame.
    closed: bool,
}

impl Channel {
    /// A channel over `stream` (non-blocking, registered with the runtime).
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            inbox: Vec::new(),
            outbox: Vec::new(),
            closed: false,
        }
    }

    /// Queues `frame`.
    /// It is sent while [`next`](Channel::next) runs (or by
    /// [`flush_now`](Channel::flush_now)).
    pub fn send(&mut self, frame: Frame) {
        if !self.closed {
            self.outbox.extend_from_slice(&frame.encode());
        }
    }

    /// Whether the other end may still send something.
    pub fn is_open(&self) -> bool {
        !self.closed || self.inbox.len() >= FRAME
    }

    /// Sends what is queued and returns the next frame received.
    /// `None` once the other end is gone (and at once from then on).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a frame received or bytes sent before the future is dropped are kept
    /// for the next call or counted as sent.
    pub async fn next(&mut self) -> Option<Frame> {
        loop {
            if self.inbox.len() >= FRAME {
                let mut frame = [0; FRAME];
                frame.copy_from_slice(&self.inbox[..FRAME]);
                self.inbox.drain(..FRAME);
                let decoded = Frame::decode(frame);
                if decoded.is_none() {
                    self.close();
                }
                return decoded;
            }
            if self.closed {
                return None;
            }
            let stream = &self.stream;
            tokio::select! {
                readable = stream.readable() => {
                    let mut buffer = [0; 64];
                    match readable.and_then(|()| stream.try_read(&mut buffer)) {
                        Ok(0) => self.close(),
                        Ok(n) => self.inbox.extend_from_slice(&buffer[..n]),
                        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => self.close(),
                    }
                }
                writable = stream.writable(), if !self.outbox.is_empty() => {
                    match writable.and_then(|()| stream.try_write(&self.outbox)) {
                        Ok(n) => {
                            self.outbox.drain(..n);
                        }
                        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                        // The other end is gone; reading says so.
                        Err(_) => self.outbox.clear(),
                    }
                }
            }
        }
    }

    /// Sends what is queued as far as the socket takes it now, without waiting.
    pub fn flush_now(&mut self) {
        while !self.outbox.is_empty() {
            match self.stream.try_write(&self.outbox) {
                Ok(n) if n > 0 => {
                    self.outbox.drain(..n);
                }
                _ => return,
            }
        }
    }

    fn close(&mut self) {
        self.closed = true;
        self.outbox.clear();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use super::*;

    #[test]
    fn frames_survive_the_trip() {
        let at = Instant::from_origin(Duration::new(12_345, 678));
        for frame in [
            Frame::Start(Some(at)),
            Frame::Start(None),
            Frame::Deadline(Some(at)),
            Frame::Deadline(None),
            Frame::Stop(15),
            Frame::Started(Pid::from_raw(4242).unwrap()),
            Frame::Stopping(at),
        ] {
            assert_eq!(Frame::decode(frame.encode()), Some(frame));
        }
        let mut unknown = Frame::Stop(9).encode();
        unknown[0] = b'?';
        assert_eq!(Frame::decode(unknown), None);
        let mut no_pid = Frame::Stop(0).encode();
        no_pid[0] = b'P';
        assert_eq!(Frame::decode(no_pid), None);
    }

    #[tokio::test]
    async fn frames_cross_the_socket_and_its_end_is_seen() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut a, mut b) = (Channel::new(a), Channel::new(b));
        a.send(Frame::Start(None));
        a.send(Frame::Stop(2));
        // `a` sends while it waits for something.
        let received = tokio::select! {
            _ = a.next() => panic!("`b` sent nothing"),
            received = async { (b.next().await, b.next().await) } => received,
        };
        assert_eq!(received, (Some(Frame::Start(None)), Some(Frame::Stop(2))));
        drop(a);
        assert_eq!(b.next().await, None);
        assert!(!b.is_open());
    }
}
