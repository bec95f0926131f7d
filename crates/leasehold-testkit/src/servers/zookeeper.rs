//! ZooKeeper: a standalone server or an ensemble.

use std::io;
use std::net::SocketAddr;
use std::path::Path;

use tempfile::TempDir;

use super::{READY_LIMIT, loopback, os, with_retries};
use crate::probe::zookeeper_word;
use crate::process::{ServerProcess, find_program, free_port, wait_ready};

const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// A ZooKeeper server or ensemble on loopback, with a 200 ms tick.
#[derive(Debug)]
pub struct ZooKeeper {
    servers: Vec<ZooKeeperServer>,
    _dir: TempDir,
}

/// One ZooKeeper server.
#[derive(Debug)]
pub struct ZooKeeperServer {
    process: ServerProcess,
    client_port: u16,
}

impl ZooKeeper {
    /// A standalone server.
    ///
    /// # Errors
    ///
    /// If ZooKeeper (or Java) is not installed or it does not start serving.
    pub async fn start() -> io::Result<ZooKeeper> {
        Self::ensemble(1).await
    }

    /// An ensemble of `n` servers (`n == 1`: standalone), returned once its election has settled.
    /// One leader, the others following it.
    ///
    /// # Errors
    ///
    /// As for [`start`](ZooKeeper::start).
    pub async fn ensemble(n: usize) -> io::Result<ZooKeeper> {
        let java = find_program("java", &[])?;
        if !Path::new(ZOOKEEPER_JAR).is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "zookeeper is not installed; ./scripts/test installs every server the tests need",
            ));
        }
        with_retries(async || {
            let dir = tempfile::tempdir()?;
            let ports: Vec<[u16; 3]> = (0..n)
                .map(|_| [free_port(), free_port(), free_port()])
                .collect();
            let mut servers = Vec::with_capacity(n);
            for (i, [client, ..]) in ports.iter().enumerate() {
                let id = i + 1;
                let data = dir.path().join(format!("zk{id}"));
                std::fs::create_dir_all(&data)?;
                std::fs::write(data.join("myid"), format!("{id}\n"))?;
                let mut config = format!(
                    "tickTime=200\ninitLimit=20\nsyncLimit=10\ndataDir={}\nclientPort={client}\n\
                     clientPortAddress=127.0.0.1\nadmin.enableServer=false\n\
                     4lw.commands.whitelist=srvr,stat,ruok,mntr,cons\nmaxSessionTimeout=60000\n\
                     maxClientCnxns=0\n",
                    data.display()
                );
                if n > 1 {
                    for (j, [_, q, e]) in ports.iter().enumerate() {
                        config.push_str(&format!("server.{}=127.0.0.1:{q}:{e}\n", j + 1));
                    }
                }
                let config_file = data.join("zoo.cfg");
                std::fs::write(&config_file, config)?;
                let args = vec![
                    "-Xmx256m".to_owned(),
                    "-XX:+UseSerialGC".into(),
                    "-XX:TieredStopAtLevel=1".into(),
                    format!("-Dzookeeper.log.dir={}", data.display()),
                    // The server's own log, timestamped, for a failed test to show.
                    "-Dorg.slf4j.simpleLogger.showDateTime=true".into(),
                    "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS".into(),
                    "-cp".into(),
                    server_classpath(),
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain".into(),
                    config_file.display().to_string(),
                ];
                let process = ServerProcess::start(
                    &format!("zookeeper {id}"),
                    &java,
                    os(&args),
                    data.join("zookeeper.log"),
                )?;
                servers.push(ZooKeeperServer {
                    process,
                    client_port: *client,
                });
            }
            let mut zookeeper = ZooKeeper { servers, _dir: dir };
            for server in &mut zookeeper.servers {
                server.wait_ready().await?;
            }
            if n > 1 {
                // Every server having a mode is not enough: while an election settles, two
                // can say "leader" for a moment. Ready is one leader and n - 1 followers.
                let addrs: Vec<SocketAddr> = zookeeper.servers.iter().map(|s| s.addr()).collect();
                let port = addrs[0].port();
                wait_ready(
                    &mut zookeeper.servers[0].process,
                    port,
                    READY_LIMIT,
                    async || {
                        let mut leaders = 0;
                        for addr in &addrs {
                            match zookeeper_mode(*addr).await.as_deref() {
                                Some("leader") => leaders += 1,
                                Some("follower") => {}
                                _ => return false,
                            }
                        }
                        leaders == 1
                    },
                )
                .await?;
            }
            Ok(zookeeper)
        })
        .await
    }

    /// `127.0.0.1:p1,127.0.0.1:p2,...`, as ZooKeeper clients take it.
    pub fn connect_string(&self) -> String {
        self.servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `zookeeper://127.0.0.1:p1,...`.
    pub fn url(&self) -> String {
        format!("zookeeper://{}", self.connect_string())
    }

    /// The client address of each server, in order.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.servers.iter().map(ZooKeeperServer::addr).collect()
    }

    /// The servers.
    pub fn servers(&mut self) -> &mut [ZooKeeperServer] {
        &mut self.servers
    }
}

/// The mode the ZooKeeper server at `addr` reports (`srvr`), if it answers.
async fn zookeeper_mode(addr: SocketAddr) -> Option<String> {
    let answer = zookeeper_word(addr, "srvr").await.ok()?;
    answer
        .lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .map(str::to_owned)
}

impl ZooKeeperServer {
    async fn wait_ready(&mut self) -> io::Result<()> {
        let addr = self.addr();
        wait_ready(&mut self.process, addr.port(), READY_LIMIT, async || {
            zookeeper_word(addr, "srvr")
                .await
                .is_ok_and(|answer| answer.contains("Mode: "))
        })
        .await
    }

    /// Its client address.
    pub fn addr(&self) -> SocketAddr {
        loopback(self.client_port)
    }

    /// `standalone`, `leader` or `follower`, as the server reports it.
    pub async fn mode(&self) -> Option<String> {
        zookeeper_mode(self.addr()).await
    }

    /// The process (pause, resume, kill, log).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Kills the server if it runs and starts it again with its data.
    ///
    /// # Errors
    ///
    /// If it does not start serving (an ensemble member needs a quorum).
    pub async fn restart(&mut self) -> io::Result<()> {
        self.process.restart()?;
        self.wait_ready().await
    }
}

/// The server's jar, with a logger when one is installed (without it the server logs nothing).
fn server_classpath() -> String {
    const LOGGER: &str = "/usr/share/java/slf4j-simple.jar";
    if Path::new(LOGGER).is_file() {
        format!("{ZOOKEEPER_JAR}:{LOGGER}")
    } else {
        ZOOKEEPER_JAR.to_owned()
    }
}

/// The jars an Apache Curator client needs (Debian's `libcurator-recipes-java`).
const CURATOR_CLASSPATH: &[&str] = &[
    "/usr/share/java/curator-recipes.jar",
    "/usr/share/java/curator-framework.jar",
    "/usr/share/java/curator-client.jar",
    "/usr/share/java/zookeeper.jar",
    "/usr/share/java/zookeeper-jute.jar",
    "/usr/share/java/guava.jar",
    "/usr/share/java/slf4j-api.jar",
    "/usr/share/java/slf4j-nop.jar",
];

/// The driver's source: a line protocol over stdin/stdout (see the file).
const CURATOR_DRIVER: &str = include_str!("CuratorDriver.java");

/// A separate Java process running Apache Curator against a ZooKeeper ensemble.
/// Curator is 5.x, Debian's `libcurator-recipes-java`: its `InterProcessMutex`, driven one
/// command at a time, and a benchmark loop. The driver is compiled with `javac` on first
/// use (cached under the temporary directory, by the hash of its source). Killed when
/// dropped.
#[derive(Debug)]
pub struct Curator {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Curator {
    /// Starts a Curator client connected to `connect`, once it is connected.
    /// `connect` is `host:port,...[/chroot]`; the session is of `session_timeout`.
    ///
    /// # Errors
    ///
    /// If Java, `javac` or Curator is not installed, the driver does not compile, or the
    /// client does not connect.
    pub async fn start(connect: &str, session_timeout: std::time::Duration) -> io::Result<Self> {
        use tokio::io::AsyncBufReadExt;
        let classes = curator_classes().await?;
        let java = find_program("java", &[])?;
        let classpath = format!("{}:{}", classes.display(), CURATOR_CLASSPATH.join(":"));
        let mut child = tokio::process::Command::new(java)
            .args([
                "-Xmx128m",
                "-XX:+UseSerialGC",
                "-cp",
                &classpath,
                "CuratorDriver",
            ])
            .arg(connect)
            .arg(session_timeout.as_millis().to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(io::Error::other("the Curator driver has no pipes"));
        };
        let mut curator = Curator {
            child,
            stdin,
            stdout: tokio::io::BufReader::new(stdout).lines(),
        };
        let ready = tokio::time::timeout(READY_LIMIT, curator.stdout.next_line())
            .await
            .map_err(|_| io::Error::other("the Curator driver did not connect in time"))??;
        if ready.as_deref() != Some("ready") {
            return Err(io::Error::other(format!(
                "the Curator driver said {ready:?} instead of ready"
            )));
        }
        Ok(curator)
    }

    /// Sends one command and returns its answer (see `CuratorDriver.java`).
    ///
    /// # Errors
    ///
    /// If the driver exited, or answered with an error.
    pub async fn command(&mut self, line: &str) -> io::Result<String> {
        use tokio::io::AsyncWriteExt;
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        let answer = self
            .stdout
            .next_line()
            .await?
            .ok_or_else(|| io::Error::other("the Curator driver exited"))?;
        match answer.strip_prefix("error ") {
            Some(error) => Err(io::Error::other(format!("Curator: {error}"))),
            None => Ok(answer),
        }
    }

    /// Acquires Curator's `InterProcessMutex` on `path`, waiting as long as it takes.
    ///
    /// # Errors
    ///
    /// As for [`command`](Curator::command).
    pub async fn lock(&mut self, path: &str) -> io::Result<()> {
        self.command(&format!("lock {path}")).await.map(drop)
    }

    /// Tries Curator's `InterProcessMutex` on `path` for up to `wait`: whether it got it.
    ///
    /// # Errors
    ///
    /// As for [`command`](Curator::command).
    pub async fn try_lock(&mut self, path: &str, wait: std::time::Duration) -> io::Result<bool> {
        let answer = self
            .command(&format!("trylock {path} {}", wait.as_millis()))
            .await?;
        Ok(answer.starts_with("locked "))
    }

    /// Releases the `InterProcessMutex` on `path`.
    ///
    /// # Errors
    ///
    /// As for [`command`](Curator::command).
    pub async fn unlock(&mut self, path: &str) -> io::Result<()> {
        self.command(&format!("unlock {path}")).await.map(drop)
    }

    /// The driver's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

/// The directory of the compiled driver, compiled on first use.
async fn curator_classes() -> io::Result<std::path::PathBuf> {
    use std::hash::{Hash, Hasher};
    for jar in CURATOR_CLASSPATH {
        if !Path::new(jar).is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{jar} is missing: Curator is not installed; ./scripts/test installs \
                     libcurator-recipes-java"
                ),
            ));
        }
    }
    let javac = find_program("javac", &[])?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    CURATOR_DRIVER.hash(&mut hasher);
    let dir = std::env::temp_dir().join(format!("leasehold-curator-{:016x}", hasher.finish()));
    if dir.join("CuratorDriver.class").is_file() {
        return Ok(dir);
    }
    // Compiled aside and renamed into place: concurrent test processes never see half.
    let work = tempfile::tempdir()?;
    let source = work.path().join("CuratorDriver.java");
    std::fs::write(&source, CURATOR_DRIVER)?;
    let out = tokio::process::Command::new(javac)
        .args(["-nowarn", "-cp", &CURATOR_CLASSPATH.join(":"), "-d"])
        .arg(work.path().join("classes"))
        .arg(&source)
        .output()
        .await?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "javac CuratorDriver.java: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    match std::fs::rename(work.path().join("classes"), &dir) {
        Ok(()) => Ok(dir),
        // Another process got there first.
        Err(_) if dir.join("CuratorDriver.class").is_file() => Ok(dir),
        Err(error) => Err(error),
    }
}
