//! PostgreSQL: one server from a template data directory; PgBouncer in front of one.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

use rustix::process::{Pid, Signal, kill_process};
use tempfile::TempDir;

use super::{READY_LIMIT, os, with_retries, write_test_certificates};
use crate::process::{ServerProcess, find_program, free_port, wait_ready};

/// Builds a [`Postgres`] with extra settings, TLS, or a fake wall clock.
#[derive(Debug, Default)]
pub struct PostgresBuilder {
    config: Vec<(String, String)>,
    tls: bool,
    faketime: Option<PathBuf>,
}

impl PostgresBuilder {
    /// Adds `-c name=value` to the command line.
    pub fn config(mut self, name: &str, value: &str) -> Self {
        self.config.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Serves TLS (`ssl=on`) with a certificate of a test CA made for this server.
    /// The certificate is for 127.0.0.1 and localhost; see [`Postgres::ca_file`].
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Runs the server under libfaketime.
    /// Its wall clock is the real one moved by the offset written in `control` (`+0`,
    /// `+3600`, `-1h`, ...), read again at every clock reading (so a jump reaches every
    /// server process at once). Its monotonic clock is left alone.
    pub fn faketime(mut self, control: &Path) -> Self {
        self.faketime = Some(control.to_owned());
        self
    }

    /// Starts the server and waits until it accepts connections.
    ///
    /// # Errors
    ///
    /// If PostgreSQL (or libfaketime, when asked for) is not installed, or the server does
    /// not accept connections.
    pub async fn start(self) -> io::Result<Postgres> {
        Postgres::start_with(self).await
    }
}

/// The libfaketime library of the Debian package `libfaketime`.
///
/// # Errors
///
/// [`io::ErrorKind::NotFound`] when it is not installed.
pub fn libfaketime() -> io::Result<PathBuf> {
    std::fs::read_dir("/usr/lib")?
        .flatten()
        .map(|dir| dir.path().join("faketime/libfaketime.so.1"))
        .find(|lib| lib.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "libfaketime is not installed; ./scripts/test installs it",
            )
        })
}

/// A PostgreSQL server on a free loopback port (`trust` authentication, user `postgres`).
/// It runs as the `postgres` user when the tests run as root. `fsync` is off: committed
/// data survives killing the server, not the machine.
#[derive(Debug)]
pub struct Postgres {
    process: ServerProcess,
    port: u16,
    bin: PathBuf,
    dir: TempDir,
}

impl Postgres {
    /// Starts a server from a data directory copied from a template made once per machine.
    /// `initdb` is the slow part.
    ///
    /// # Errors
    ///
    /// If PostgreSQL is not installed or does not accept connections.
    pub async fn start() -> io::Result<Postgres> {
        Self::builder().start().await
    }

    /// A builder for a server with extra settings, TLS or a fake wall clock.
    pub fn builder() -> PostgresBuilder {
        PostgresBuilder::default()
    }

    async fn start_with(builder: PostgresBuilder) -> io::Result<Postgres> {
        let bin = postgres_bin()?;
        let env: Vec<(OsString, OsString)> = match &builder.faketime {
            Some(control) => vec![
                ("LD_PRELOAD".into(), libfaketime()?.into()),
                ("FAKETIME_TIMESTAMP_FILE".into(), control.into()),
                ("FAKETIME_NO_CACHE".into(), "1".into()),
                ("DONT_FAKE_MONOTONIC".into(), "1".into()),
            ],
            None => Vec::new(),
        };
        let user = postgres_user()?;
        let template = tokio::task::spawn_blocking({
            let bin = bin.clone();
            move || postgres_template(&bin, user)
        })
        .await
        .map_err(io::Error::other)??;
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let data = dir.path().join("data");
            let copied = std::process::Command::new("cp")
                .arg("-a")
                .arg(&template)
                .arg(&data)
                .status()?;
            if !copied.success() {
                return Err(io::Error::other("copying the PostgreSQL template failed"));
            }
            if let Some((uid, gid)) = user {
                chown(dir.path(), uid, gid)?;
                chown(&data, uid, gid)?;
            }
            let port = free_port();
            let mut args = vec![
                "-D".to_owned(),
                data.display().to_string(),
                "-p".into(),
                port.to_string(),
                "-k".into(),
                dir.path().display().to_string(),
                "-c".into(),
                "listen_addresses=127.0.0.1".into(),
                "-c".into(),
                "fsync=off".into(),
                "-c".into(),
                "full_page_writes=off".into(),
                "-c".into(),
                "shared_buffers=16MB".into(),
            ];
            if builder.tls {
                write_test_certificates(dir.path())?;
                if let Some((uid, gid)) = user {
                    for file in ["server.crt", "server.key", "ca.crt"] {
                        chown(&dir.path().join(file), uid, gid)?;
                    }
                }
                for (name, file) in [
                    ("ssl_cert_file", "server.crt"),
                    ("ssl_key_file", "server.key"),
                ] {
                    args.push("-c".into());
                    args.push(format!("{name}={}", dir.path().join(file).display()));
                }
                args.extend(["-c".into(), "ssl=on".into()]);
            }
            for (name, value) in &builder.config {
                args.push("-c".into());
                args.push(format!("{name}={value}"));
            }
            let process = ServerProcess::start_as(
                "postgres",
                &bin.join("postgres"),
                os(&args),
                env.clone(),
                user,
                dir.path().join("postgres.log"),
            )?;
            let mut postgres = Postgres {
                process,
                port,
                bin: bin.clone(),
                dir,
            };
            postgres.wait_ready().await?;
            Ok(postgres)
        })
        .await
    }

    async fn wait_ready(&mut self) -> io::Result<()> {
        let isready = self.bin.join("pg_isready");
        let port = self.port.to_string();
        wait_ready(&mut self.process, self.port, READY_LIMIT, async || {
            tokio::process::Command::new(&isready)
                .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-p", &port])
                .status()
                .await
                .is_ok_and(|s| s.success())
        })
        .await
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:port/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// The test CA's certificate of a server started with [`PostgresBuilder::tls`].
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Stops the server as `pg_ctl stop -m immediate` does and starts it again with its data.
    /// Every process stops at once, with no checkpoint; the server recovers its data from
    /// its log. After a SIGKILL of the postmaster it starts once the old backends are gone.
    ///
    /// # Errors
    ///
    /// If it does not accept connections again.
    pub async fn restart(&mut self) -> io::Result<()> {
        // SIGQUIT is `pg_ctl stop -m immediate`: the postmaster kills its children (each in
        // a process group of its own) and exits without a checkpoint; the next start runs
        // crash recovery. SIGKILL if it does not go.
        let pid = self
            .process
            .pid()
            .and_then(|pid| Pid::from_raw(i32::try_from(pid).ok()?));
        if let Some(pid) = pid {
            let _ = kill_process(pid, Signal::QUIT);
            let started = std::time::Instant::now();
            while !self.process.exited() {
                if started.elapsed() > READY_LIMIT {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
        // A postmaster killed with SIGKILL leaves its backends behind, holding its shared
        // memory until each notices the postmaster is gone; a start before then is refused.
        let started = std::time::Instant::now();
        loop {
            self.process.restart()?;
            match self.wait_ready().await {
                Err(e)
                    if e.to_string().contains("shared memory block")
                        && started.elapsed() < READY_LIMIT =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                ready => return ready,
            }
        }
    }
}

fn postgres_bin() -> io::Result<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "PostgreSQL is not installed under /usr/lib/postgresql",
        )
    })
}

/// `(uid, gid)` of the `postgres` user when running as root (PostgreSQL refuses root).
/// `None` when not root.
fn postgres_user() -> io::Result<Option<(u32, u32)>> {
    if !rustix::process::getuid().is_root() {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres") && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .map(Some)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "running as root, but there is no postgres user to run PostgreSQL as",
            )
        })
}

fn chown(path: &Path, uid: u32, gid: u32) -> io::Result<()> {
    rustix::fs::chown(
        path,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    )
    .map_err(io::Error::from)
}

/// The initdb'd template data directory.
/// It is made once per machine under an exclusive file lock so that concurrent test
/// processes do not race.
fn postgres_template(bin: &Path, user: Option<(u32, u32)>) -> io::Result<PathBuf> {
    let version = bin
        .parent()
        .and_then(Path::file_name)
        .and_then(|v| v.to_str())
        .unwrap_or("pg");
    let root = std::env::temp_dir().join(format!("leasehold-testkit-postgres-{version}"));
    let template = root.join("data");
    std::fs::create_dir_all(&root)?;
    let lock = std::fs::File::create(root.join("lock"))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)?;
    if root.join("ready").is_file() {
        return Ok(template);
    }
    let _ = std::fs::remove_dir_all(&template);
    std::fs::create_dir_all(&template)?;
    if let Some((uid, gid)) = user {
        chown(&template, uid, gid)?;
    }
    let mut initdb = std::process::Command::new(bin.join("initdb"));
    initdb
        .args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
            "-D",
        ])
        .arg(&template)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    if let Some((uid, gid)) = user {
        use std::os::unix::process::CommandExt;
        initdb.uid(uid).gid(gid).current_dir("/");
    }
    let out = initdb.output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    std::fs::write(root.join("ready"), b"")?;
    Ok(template)
}

/// PgBouncer's pooling modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A server session per client session.
    Session,
    /// A server session per transaction.
    /// Session state (LISTEN, session advisory locks, named prepared statements) does not
    /// survive a transaction.
    Transaction,
}

/// A PgBouncer in front of a [`Postgres`], on a free loopback port (`trust` authentication).
/// It runs as the `postgres` user when the tests run as root.
#[derive(Debug)]
pub struct PgBouncer {
    process: ServerProcess,
    port: u16,
    _dir: TempDir,
}

impl PgBouncer {
    /// Starts PgBouncer pooling `mode` in front of `postgres`'s database `postgres`.
    ///
    /// # Errors
    ///
    /// If PgBouncer is not installed or does not accept connections.
    pub async fn start(postgres: &Postgres, mode: PoolMode) -> io::Result<PgBouncer> {
        let program = find_program("pgbouncer", &["/usr/sbin"])?;
        let user = postgres_user()?;
        let isready = postgres_bin()?.join("pg_isready");
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let port = free_port();
            let mode = match mode {
                PoolMode::Session => "session",
                PoolMode::Transaction => "transaction",
            };
            let users = dir.path().join("users.txt");
            std::fs::write(&users, "\"postgres\" \"\"\n")?;
            let ini = dir.path().join("pgbouncer.ini");
            std::fs::write(
                &ini,
                format!(
                    "[databases]\npostgres = host=127.0.0.1 port={} dbname=postgres\n\
                     [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                     unix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
                     pool_mode = {mode}\nmax_client_conn = 500\ndefault_pool_size = 20\n",
                    postgres.port(),
                    users.display()
                ),
            )?;
            if let Some((uid, gid)) = user {
                for path in [dir.path(), &users, &ini] {
                    chown(path, uid, gid)?;
                }
            }
            let process = ServerProcess::start_as(
                "pgbouncer",
                &program,
                vec![ini.into()],
                Vec::new(),
                user,
                dir.path().join("pgbouncer.log"),
            )?;
            let mut bouncer = PgBouncer {
                process,
                port,
                _dir: dir,
            };
            let listening = bouncer.port;
            let port = port.to_string();
            wait_ready(&mut bouncer.process, listening, READY_LIMIT, async || {
                tokio::process::Command::new(&isready)
                    .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-p", &port])
                    .status()
                    .await
                    .is_ok_and(|s| s.success())
            })
            .await?;
            Ok(bouncer)
        })
        .await
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:port/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }
}
