//! PostgreSQL (lease mode): one server, under libfaketime where it is installed so that
//! scenario 10 can move the server's wall clock (the one its leases are counted on).

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use leasehold_testkit::Postgres;

use super::{BackendSpec, ServerClock, Servers, Traits};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "postgres",
    scheme: "postgres",
    traits: Traits {
        servers: true,
        network: true,
        processes: true,
        expiring: true,
        sessions: false,
        server_clock: ServerClock::Faketime,
        restart_loses_locks: false,
    },
    ttl: Duration::from_millis(1000),
    start: |_| Box::pin(start()),
    url: |eps, _| {
        format!(
            "postgres://postgres@{}/postgres",
            eps.first().map_or("", String::as_str)
        )
    },
};

/// A server's wall clock, moved through libfaketime's control file.
#[derive(Debug)]
pub struct ServerWallClock {
    dir: tempfile::TempDir,
}

impl ServerWallClock {
    fn new() -> io::Result<Self> {
        let dir = tempfile::tempdir()?;
        // The server may run as the `postgres` user.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;
        let clock = ServerWallClock { dir };
        clock.set_offset(0)?;
        Ok(clock)
    }

    fn control(&self) -> PathBuf {
        self.dir.path().join("faketime")
    }

    /// Moves the server's wall clock to the real one plus `seconds`; every server process
    /// sees it at its next clock reading.
    ///
    /// # Errors
    ///
    /// If the control file cannot be written.
    pub fn set_offset(&self, seconds: i64) -> io::Result<()> {
        std::fs::write(self.control(), format!("{seconds:+}\n"))
    }
}

async fn start() -> io::Result<Servers> {
    let clock = ServerWallClock::new()?;
    match Postgres::builder().faketime(&clock.control()).start().await {
        Ok(pg) => Ok(Servers::Postgres(pg, Some(clock))),
        // Without libfaketime every scenario but the server clock jump still runs.
        Err(e) if e.kind() == io::ErrorKind::NotFound && e.to_string().contains("libfaketime") => {
            Ok(Servers::Postgres(Postgres::start().await?, None))
        }
        Err(e) => Err(e),
    }
}
