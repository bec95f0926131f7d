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
//! | `#records/N/<key>` | a record beside `N` (see [`Layout::record`]) |
//! | `#evictions/N/<token>` | the record of an eviction of `N`'s grant with that token (see [`Layout::eviction`]) |
//!
//! `<lease>` is the session's lease id in hex, `<slot>` a number the session reuses once
//! the key is gone. Names cannot contain `#` or `/`, so no name's keys fall into another
//! name's directories, and no contender directory holds a marker, a permit, a fence or a
//! record.

use leasehold_core::backend::Mode;
use leasehold_core::{LockName, NamePrefix, RecordKey};

use crate::requests::prefix_end;

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

    /// The keys of every name that begins with `prefix`: `[start, end)`.
    /// Without a root or a prefix, that is the whole keyspace (etcd's `\0` to `\0`).
    pub(crate) fn names_range(&self, prefix: &NamePrefix) -> (Vec<u8>, Vec<u8>) {
        let start = self.names_start(prefix);
        if start.is_empty() {
            return (vec![0], vec![0]);
        }
        let end = prefix_end(&start);
        (start, end)
    }

    /// What every key of a name that begins with `prefix` begins with.
    pub(crate) fn names_start(&self, prefix: &NamePrefix) -> Vec<u8> {
        format!("{}{}", self.root, prefix.as_str()).into_bytes()
    }

    /// Where the keys of `name` lie: every one of them is in `[start, end)`.
    /// The keys of names that continue `name` with `+`, `-` or `.` lie in there too, as
    /// those characters sort between `#` and `/`.
    pub(crate) fn span(&self, name: &LockName) -> (Vec<u8>, Vec<u8>) {
        let root = &self.root;
        (
            format!("{root}{name}#").into_bytes(),
            prefix_end(format!("{root}{name}/")),
        )
    }

    /// The name whose contender directory holds `key`, and whether it is the permit set's.
    /// `None` for any other key: a lock-delay marker, a session's fence, a key outside the
    /// root or one that names no lock.
    pub(crate) fn contender(&self, key: &[u8]) -> Option<(LockName, bool)> {
        let rest = key.strip_prefix(self.root.as_bytes())?;
        let end = rest.iter().position(|b| matches!(b, b'/' | b'#'))?;
        let (name, dir) = rest.split_at(end);
        let permit = if dir.starts_with(b"/") {
            false
        } else if dir.starts_with(b"#permits/") {
            true
        } else {
            return None;
        };
        let name = LockName::new(std::str::from_utf8(name).ok()?).ok()?;
        Some((name, permit))
    }

    /// The name whose state `key` is part of: a contender, a lock-delay marker or a record.
    /// That is `N` for `N/…` and `N#…` (its permits and markers) and for `#records/N/…`;
    /// `None` for a session's fence, a key outside the root, or one that names no lock.
    pub(crate) fn lock_of(&self, key: &[u8]) -> Option<LockName> {
        let rest = key.strip_prefix(self.root.as_bytes())?;
        let (name, after) = match rest.strip_prefix(b"#records/") {
            Some(record) => {
                let end = record.iter().position(|b| *b == b'/')?;
                (&record[..end], &record[end..])
            }
            None => {
                let end = rest.iter().position(|b| matches!(b, b'/' | b'#'))?;
                (&rest[..end], &rest[end..])
            }
        };
        // A name's keys all go on past it: `N` alone is no key of this layout.
        if after.len() < 2 {
            return None;
        }
        LockName::new(std::str::from_utf8(name).ok()?).ok()
    }

    /// The names whose [`span`](Layout::span) starts before `key` and ends after it.
    /// Each is `key` (past the root) cut before a `+`, `-`, `.`, `#` or `/` that comes
    /// before the first `#` or `/`.
    pub(crate) fn cut_at(&self, key: &[u8]) -> Vec<LockName> {
        let Some(rest) = key.strip_prefix(self.root.as_bytes()) else {
            return Vec::new();
        };
        let mut names = Vec::new();
        for (i, byte) in rest.iter().enumerate().skip(1) {
            if !(b'#'..=b'/').contains(byte) {
                continue;
            }
            if let Some(name) = std::str::from_utf8(&rest[..i])
                .ok()
                .and_then(|name| LockName::new(name).ok())
            {
                names.push(name);
            }
            if matches!(byte, b'#' | b'/') {
                break;
            }
        }
        names
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

    /// The key of the record `key` beside `name`.
    ///
    /// Records live apart from every name's keys, under `#records/`: no queue read, no
    /// inspection and no watch of a name reads them, and a listing of every name, which
    /// reads every key under the root, finds no contender directory in them (see
    /// [`contender`](Layout::contender)). Neither names nor record keys contain `/`, so
    /// `N/<key>` names one record of one name.
    pub(crate) fn record(&self, name: &LockName, key: &RecordKey) -> String {
        format!("{}#records/{name}/{key}", self.root)
    }
}

impl Layout {
    /// The key of the record of the eviction of `name`'s grant created at `revision`.
    ///
    /// Eviction records live apart from every name's keys, as records do: no queue read
    /// and no listing reads them as contenders. The token is written in 20 digits, so the
    /// records of a name sort by token, the newest last.
    pub(crate) fn eviction(&self, name: &LockName, revision: i64) -> String {
        format!("{}{revision:020}", self.evictions(name))
    }

    /// The directory of the eviction records of `name`.
    pub(crate) fn evictions(&self, name: &LockName) -> String {
        format!("{}#evictions/{name}/", self.root)
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
        let key = RecordKey::new("window:1").unwrap();
        assert_eq!(plain.record(&name, &key), "#records/job/window:1");
        assert_eq!(
            plain.eviction(&name, 42),
            "#evictions/job/00000000000000000042"
        );
        assert_eq!(plain.lock_of(plain.eviction(&name, 42).as_bytes()), None);
        assert_eq!(plain.contender(plain.eviction(&name, 42).as_bytes()), None);
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

    #[test]
    fn every_key_of_a_name_leads_back_to_it_and_no_other_key_does() {
        let name = |n: &str| Some(LockName::new(n).unwrap());
        for layout in [Layout::new(""), Layout::new("L")] {
            let key = |k: &str| {
                let mut full = layout.root.clone().into_bytes();
                full.extend_from_slice(k.as_bytes());
                full
            };
            for (k, lock) in [
                ("a.b/2a.0", "a.b"),
                ("a/694d7a8e5c0d4b04", "a"),
                ("a#delay/2a.0", "a"),
                ("a#permits/2a.0", "a"),
                ("a#permits#delay/2a.0", "a"),
                ("#records/jobs:x/window:1", "jobs:x"),
            ] {
                assert_eq!(layout.lock_of(&key(k)), name(lock), "{k}");
            }
            for other in [
                "#sessions/2a",
                "#records/jobs:x",
                "#records//k",
                "a",
                "a/",
                ".a/2a.0",
                "/2a.0",
                "a\u{e9}/2a.0",
            ] {
                assert_eq!(layout.lock_of(&key(other)), None, "{other}");
            }
        }
        assert_eq!(Layout::new("L").lock_of(b"M/a/2a.0"), None);
    }

    #[test]
    fn a_listing_finds_each_names_keys_and_the_names_cut_at_a_key() {
        let layout = Layout::new("L");
        let name = |n: &str| LockName::new(n).unwrap();
        let prefix = NamePrefix::new("a").unwrap();
        assert_eq!(
            layout.names_range(&prefix),
            (b"L/a".to_vec(), b"L/b".to_vec())
        );
        let all = NamePrefix::new("").unwrap();
        assert_eq!(Layout::new("").names_range(&all), (vec![0], vec![0]));
        assert_eq!(
            layout.span(&name("a")),
            (b"L/a#".to_vec(), b"L/a0".to_vec())
        );
        assert_eq!(layout.contender(b"L/a.b/2a.0"), Some((name("a.b"), false)));
        assert_eq!(
            layout.contender(b"L/a#permits/2a.0"),
            Some((name("a"), true))
        );
        for other in [
            &b"L/a#delay/2a.0"[..],
            b"L/a#permits#delay/2a.0",
            b"L/#sessions/2a",
            b"L/#records/a/window:1",
            b"M/a/2a.0",
            b"L/.a/2a.0",
            b"L/a",
        ] {
            assert_eq!(layout.contender(other), None, "{other:?}");
        }
        // "a" spans "a#…" to "a/…", so "a.b/…" and "a.b-c/…" lie inside it.
        assert_eq!(
            layout.cut_at(b"L/a.b-c/2a.0\0"),
            [name("a"), name("a.b"), name("a.b-c")]
        );
        assert_eq!(layout.cut_at(b"L/a#permits/2a.0\0"), [name("a")]);
        assert!(layout.cut_at(b"L/a").is_empty());
        assert!(layout.cut_at(b"L/#records/a/k\0").is_empty());
        assert!(layout.cut_at(b"M/a/2a.0").is_empty());
        for key in [&b"L/a.b-c/2a.0"[..], b"L/a#permits/1.0"] {
            for cut in layout.cut_at(key) {
                let (start, end) = layout.span(&cut);
                assert!(
                    start.as_slice() < key && key < end.as_slice(),
                    "{cut} at {key:?}"
                );
            }
        }
    }
}
