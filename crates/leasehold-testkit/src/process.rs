//! One server process started by a test.
//! It logs to a file, can be paused, resumed, killed and restarted with the same command
//! line, and is killed when its handle drops or when the test process dies. A test that
//! fails shows the end of the logs of the servers it started.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

/// A server process owned by a test.
#[derive(Debug)]
pub struct ServerProcess {
    label: String,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    uid: Option<u32>,
    gid: Option<u32>,
    log: PathBuf,
    child: Option<Child>,
}

impl ServerProcess {
    /// Starts `program args`, appending its output to `log`.
    pub(crate) fn start(
        label: &str,
        program: &Path,
        args: Vec<OsString>,
        log: PathBuf,
    ) -> io::Result<Self> {
        Self::start_as(label, program, args, Vec::new(), None, log)
    }

    /// As [`start`](Self::start), with extra environment and optionally as another user.
    /// The user is `(uid, gid)`; that needs root.
    pub(crate) fn start_as(
        label: &str,
        program: &Path,
        args: Vec<OsString>,
        env: Vec<(OsString, OsString)>,
        user: Option<(u32, u32)>,
        log: PathBuf,
    ) -> io::Result<Self> {
        let mut process = Self {
            label: label.to_owned(),
            program: program.to_owned(),
            args,
            env,
            uid: user.map(|(uid, _)| uid),
            gid: user.map(|(_, gid)| gid),
            log,
            child: None,
        };
        process.spawn()?;
        Ok(process)
    }

    fn spawn(&mut self) -> io::Result<()> {
        let log = File::options().create(true).append(true).open(&self.log)?;
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        if let Some(gid) = self.gid {
            command.gid(gid);
        }
        if let Some(uid) = self.uid {
            command.uid(uid);
        }
        // SAFETY: only an async-signal-safe system call runs between fork and exec.
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(|| {
                // Die with the test process, even if it is killed before dropping us.
                rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
                    .map_err(io::Error::from)
            });
        }
        let child = command.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("starting {} ({}): {e}", self.label, self.program.display()),
            )
        })?;
        self.child = Some(child);
        Ok(())
    }

    /// The label given at start ("redis-server", "etcd member 2", ...).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn signal(&self, signal: Signal) {
        if let Some(pid) = self.pid().and_then(|p| Pid::from_raw(p as i32)) {
            let _ = kill_process(pid, signal);
        }
    }

    /// SIGSTOP: the server stops answering but keeps its sockets open.
    pub fn pause(&self) {
        self.signal(Signal::STOP);
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal(Signal::CONT);
    }

    /// Whether the process has exited (it is reaped if so).
    pub fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// SIGKILL, and wait for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, up to 10 s to exit, then SIGKILL.
    pub fn stop(&mut self) {
        self.signal(Signal::CONT);
        self.signal(Signal::TERM);
        let started = Instant::now();
        while !self.exited() && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    /// Kills the process if it runs, and starts the same command again.
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        self.spawn()
    }

    /// What the process wrote so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last lines of the log.
    pub(crate) fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for ServerProcess {
    /// Kills the process, and shows the end of its log if the test is failing.
    /// The test harness shows what a failed test wrote with its failure.
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- the end of the log of {} ---\n{}",
                self.label,
                self.log_tail()
            );
        }
    }
}

/// Polls `check` until it succeeds on `process` itself, or `limit` passes.
/// It fails early if `process` exits. A check counts only once `process` listens on loopback
/// `port`: a server that lost its port to another test's (between `free_port` and its
/// bind) must not pass for ready because the other one answered. Readiness of an external
/// program has no event to await, so this is the one place the testkit polls.
pub(crate) async fn wait_ready(
    process: &mut ServerProcess,
    port: u16,
    limit: Duration,
    mut check: impl AsyncFnMut() -> bool,
) -> io::Result<()> {
    let started = Instant::now();
    loop {
        if check().await && process.pid().is_none_or(|pid| listens_on(pid, port)) {
            return Ok(());
        }
        if process.exited() {
            return Err(io::Error::other(format!(
                "{} exited during start-up:\n{}",
                process.label(),
                process.log_tail()
            )));
        }
        if started.elapsed() > limit {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} did not become ready within {limit:?}:\n{}",
                    process.label(),
                    process.log_tail()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether process `pid` holds a TCP socket listening on `port` (any address, IPv4 or 6).
/// Read from `/proc`; where that cannot be read (another user's process, without
/// `CAP_SYS_PTRACE`, or no socket table at all), it is taken to, as before the check. A
/// kernel without IPv6 has no `tcp6` table: the IPv4 one is enough.
fn listens_on(pid: u32, port: u16) -> bool {
    let mut sockets = Vec::new();
    let mut tables = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(table) = std::fs::read_to_string(table) else {
            continue;
        };
        tables += 1;
        // `sl local_address rem_address st … inode`, the address `HEX:PORT`; 0A is LISTEN.
        let wanted = format!(":{port:04X}");
        sockets.extend(
            (table.lines().skip(1))
                .map(|line| line.split_whitespace().collect::<Vec<_>>())
                .filter(|f| f.len() > 9 && f[1].ends_with(&wanted) && f[3] == "0A")
                .map(|f| format!("socket:[{}]", f[9])),
        );
    }
    if tables == 0 {
        return true;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return true;
    };
    // Root lists another user's descriptors, but reads their links only with CAP_SYS_PTRACE.
    let mut readable = false;
    for fd in fds.flatten() {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            readable = true;
            if sockets.iter().any(|s| target.as_os_str() == s.as_str()) {
                return true;
            }
        }
    }
    !readable
}

/// A loopback port nobody listens on right now.
/// Another process may take it before the server binds it; server start-ups retry with a
/// fresh port when that happens.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// Finds `program` on `PATH` or in `extra` directories.
pub(crate) fn find_program(program: &str, extra: &[&str]) -> io::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(extra.iter().map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{program} is not installed; ./scripts/test installs every server the tests need"
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use super::*;

    /// A process that does not listen on the port is not ready, whoever answers there.
    /// Here the test itself answers on the port, as another test's server would after
    /// taking the port first; the "server" (`sleep`) listens on nothing.
    #[tokio::test]
    async fn another_process_answering_on_the_port_is_not_the_server_being_ready() {
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = other.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port));
        let dir = tempfile::tempdir().unwrap();
        let sleep = find_program("sleep", &[]).unwrap();
        let mut server =
            ServerProcess::start("sleep", &sleep, vec!["60".into()], dir.path().join("log"))
                .unwrap();
        assert!(!listens_on(server.pid().unwrap(), port));
        let answered = wait_ready(&mut server, port, Duration::from_millis(300), async || {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        let error = answered.expect_err("ready on another process's answer");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut, "{error}");
    }
}
