//! etcd: one member, or a cluster of three; the session lease is the run's ttl.

use std::time::Duration;

use super::{BackendSpec, Home, ServerClock, Traits, whole_seconds};

/// The registry entry.
pub static SPEC: BackendSpec = BackendSpec {
    name: "etcd",
    scheme: "etcd",
    traits: Traits {
        servers: true,
        network: true,
        processes: true,
        expiring: true,
        sessions: true,
        // libfaketime cannot reach a Go binary, and etcd's leases run on its monotonic
        // clock anyway.
        server_clock: ServerClock::None,
        restart_loses_locks: false,
    },
    ttl: Duration::from_millis(1000),
    home: Home::Servers,
    url: |eps, ttl| {
        format!(
            "etcd://{}?session_ttl={}s",
            eps.join(","),
            whole_seconds(ttl)
        )
    },
};

/// Whether the installed etcd revokes leases from a leader that was paused.
/// A stale leader's revocations are forwarded to the new leader: etcd-io/etcd#12528, fixed
/// by etcd-io/etcd#16822 in 3.4.28 and 3.5.11. Such an etcd can grant a lock twice when its
/// leader is paused past the session ttl.
pub fn revokes_from_a_stale_leader() -> bool {
    static AFFECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AFFECTED.get_or_init(|| {
        let Ok(out) = std::process::Command::new("etcd").arg("--version").output() else {
            return false;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(version) = text
            .lines()
            .find_map(|l| l.strip_prefix("etcd Version: "))
            .map(str::trim)
        else {
            return false;
        };
        let parts: Vec<u32> = version.split('.').filter_map(|p| p.parse().ok()).collect();
        matches!(parts.as_slice(), [3, minor, patch, ..] if (*minor < 4) || (*minor == 4 && *patch < 28) || (*minor == 5 && *patch < 11))
    })
}
