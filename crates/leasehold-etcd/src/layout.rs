//! Where keys live and how they are named.
//!
//! With no prefix, the keys of lock name `N` are (with a prefix `P`, each starts with
//! `P/`):
//!
//! | key | what |
//! |---|---|
//! | `N/<lease>.<slot>` | an exclusive or shared contender: etcd's own lock recipe (`concurrency.Mutex`, `etcdctl lock N`, the Lock RPC) puts its contenders in the same directory, so both exclude each other |
//! | `N#delay/<lease>.<slot>` | the lock-delay marker of the contender of the same name |
//! | `N#permits/<lease>.<slot>` | a semaphore permit holder or waiter |
//! | `N#permits#delay/<lease>.<slot>` | a permit's lock-delay marker |
//! | `#sessions/<lease>` | a session's fence (see [`Layout::anchor`]) |
//!
//! `<lease>` is the session's lease id in hex, `<slot>` a number the session reuses once
//! the key is gone. Names cannot contain `#` or `/`, so no name's keys fall into another
//! name's directories, and no contender directory holds a marker, a permit or a fence.

use leasehold_core::LockName;
use leasehold_core::backend::Mode;

/// The value of a lock-delay marker starts with this, then the owner.
/// A marker is put beside a grant of a request with a lock-delay, bound to the session's
/// delay lease (which outlives the session's own by the delay), and deleted with the key on
/// release; a marker whose owner has no key left in the queue means its holder vanished
/// without releasing, and closes the queue until it expires.
pub(crate) const MARKER: &[u8] = b"d ";

/// Where keys live: the prefix as given (none, or `P`, which puts every key under `P/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    root: String,
}

impl Layout {
    pub(crate) fn new(prefix: &str) -> Self {
        let root = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        Self { root }
    }

    /// The directories of `name`'s set for `mode`.
    pub(crate) fn set(&self, name: &LockName, mode: Mode) -> Set {
        let root = &self.root;
        if mode.is_permit() {
            Set {
                dir: format!("{root}{name}#permits/"),
                markers: format!("{root}{name}#permits#delay/"),
            }
        } else {
            Set {
                dir: format!("{root}{name}/"),
                markers: format!("{root}{name}#delay/"),
            }
        }
    }

    /// The prefixes of every key of `name`: its contender directory and `<name>#`.
    /// The second holds its permits and markers.
    pub(crate) fn all_of(&self, name: &LockName) -> [String; 2] {
        let root = &self.root;
        [format!("{root}{name}/"), format!("{root}{name}#")]
    }

    /// The fence key of the session with lease `lease`.
    ///
    /// # The fence
    ///
    /// Every put of a contender key compares the fence key's mod revision with the one the
    /// session last saw. An acquisition that sent a put whose answer never came bumps the
    /// fence (a put that changes nothing else) in the same transaction that removes its
    /// key, so that put — held up in a paused member, say — can no longer land after its
    /// acquisition gave up: it would leave a holder or waiter nobody deletes for the
    /// session's life. The fence key is bound to the session lease and goes with it.
    pub(crate) fn anchor(&self, lease: i64) -> String {
        format!("{}#sessions/{lease:x}", self.root)
    }
}

/// The two directories of one set of a name: contenders and their lock-delay markers.
/// The contenders are its holders and waiters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Set {
    pub(crate) dir: String,
    pub(crate) markers: String,
}

/// Whether `key` in `dir` is named as this backend names its keys (`<lease>.<slot>`).
pub(crate) fn is_ours(dir: &str, key: &[u8]) -> bool {
    let Some(name) = key.strip_prefix(dir.as_bytes()) else {
        return false;
    };
    let Some(dot) = name.iter().position(|b| *b == b'.') else {
        return false;
    };
    let (lease, slot) = (&name[..dot], &name[dot + 1..]);
    !lease.is_empty()
        && !slot.is_empty()
        && lease.iter().all(u8::is_ascii_hexdigit)
        && slot.iter().all(u8::is_ascii_digit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_etcds_lock_directories() {
        let name = LockName::new("job").unwrap();
        let plain = Layout::new("");
        assert_eq!(plain.set(&name, Mode::Exclusive).dir, "job/");
        assert_eq!(plain.set(&name, Mode::Shared).markers, "job#delay/");
        let limit = std::num::NonZeroU32::MIN;
        assert_eq!(plain.set(&name, Mode::Permit { limit }).dir, "job#permits/");
        assert_eq!(plain.anchor(0x2a), "#sessions/2a");
        let prefixed = Layout::new("/locks");
        assert_eq!(prefixed.set(&name, Mode::Exclusive).dir, "/locks/job/");
        assert_eq!(prefixed.all_of(&name), ["/locks/job/", "/locks/job#"]);
        // Only keys named <hex>.<digits> are this backend's; etcd's Mutex names its key
        // after the lease alone.
        assert!(is_ours("job/", b"job/694d7a8e5c0d4b04.3"));
        for foreign in [
            &b"job/694d7a8e5c0d4b04"[..],
            b"job/x.1",
            b"job/.1",
            b"other/1.2",
        ] {
            assert!(!is_ours("job/", foreign), "{foreign:?}");
        }
    }
}
