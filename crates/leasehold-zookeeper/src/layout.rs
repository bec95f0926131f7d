//! Where a lock's nodes live and how they are named.
//!
//! Under the chroot, with the default prefix `leasehold`:
//!
//! ```text
//! /leasehold                       persistent; its data is the epoch (see `session`)
//! /leasehold/<name>                the lock set: exclusive and shared contenders
//!     <owner>-x-lock-0000000042    an exclusive contender (mutex, writer, candidate)
//!     <owner>-s-lock-0000000043    a shared contender (reader)
//!     _c_<uuid>-lock-0000000044    Apache Curator's InterProcessMutex: exclusive
//!     <owner>-m-lock-9999999999    a lock-delay marker (ephemeral, of another session)
//! /leasehold/<name>#permits        the permit set (semaphore)
//!     <owner>-p<limit>-lock-0000000007
//! /leasehold/#records               records beside locks (a container node)
//!     <name>                        a name's records (a container node)
//!         <key>                     one record (persistent; see `records`)
//! /leasehold/#sessions               the sessions' timeouts (persistent)
//!     <session id>                  its negotiated timeout in ms (ephemeral; see `evict`)
//! /leasehold/#evictions             eviction records (a container node)
//!     <name>                        a name's (a container node)
//!         <token>                   one eviction, in 20 digits (persistent; see `evict`)
//! ```
//!
//! Contenders are EPHEMERAL_SEQUENTIAL children, ordered by the sequence number ZooKeeper
//! appends. Every name ends in `lock-<sequence>`, as Curator's do, because Curator orders
//! a directory's children by what follows the last `lock-`: so Curator and leasehold agree
//! on the order, and on who holds. The owner id in the name is Curator's "protection
//! mode": after a create whose reply was lost, listing the directory finds the node.
//! Lock names cannot contain `/` or `#` (the core's name rules), so a name never reaches
//! into another lock's directory. A lock-delay marker lives beside the contenders (so that
//! one listing shows both), named to sort after every contender for any recipe that takes
//! it for one. Records live apart from every lock's directory, under a child of the root
//! that no lock name can be (it has a `#`): no queue listing sees them, and a listing of
//! the root skips it.

use std::num::NonZeroU32;

use leasehold_core::backend::Mode;
use leasehold_core::{LockName, OwnerId, RecordKey};

/// What every contender's name ends with before the sequence number (Curator's `lockName`).
const LOCK_SUFFIX: &str = "-lock-";

/// What the directory of a name's permit set adds to the name.
const PERMITS: &str = "#permits";

/// The child of the root that holds the records, by name: no lock's directory.
const RECORDS: &str = "#records";

/// The child of the root that holds the eviction records, by name: no lock's directory.
const EVICTIONS: &str = "#evictions";

/// The child of the root where each session says its timeout, by name: no lock's directory.
const SESSIONS: &str = "#sessions";

/// The node under `root` where the session `id` says its negotiated timeout.
/// An eviction of one of its grants reads it (see `evict`).
pub(crate) fn session_node(root: &str, id: i64) -> String {
    format!("{root}/{SESSIONS}/{id:x}")
}

/// The paths of the nodes of this client's locks.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// `/<prefix>`.
    root: String,
}

impl Layout {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            root: format!("/{prefix}"),
        }
    }

    /// `/<prefix>`: the parent of every lock, and the epoch node.
    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    /// The directory of `name`'s contenders in `mode`'s set.
    pub(crate) fn dir(&self, name: &LockName, mode: Mode) -> String {
        match mode {
            Mode::Permit { .. } => format!("{}/{name}{PERMITS}", self.root),
            Mode::Exclusive | Mode::Shared => format!("{}/{name}", self.root),
        }
    }

    /// The directory of every name's records.
    pub(crate) fn records(&self) -> String {
        format!("{}/{RECORDS}", self.root)
    }

    /// The directory of `name`'s records.
    pub(crate) fn records_dir(&self, name: &str) -> String {
        format!("{}/{RECORDS}/{name}", self.root)
    }

    /// The directory of `name`'s eviction records (a container node).
    pub(crate) fn evictions(&self, name: &LockName) -> String {
        format!("{}/{EVICTIONS}/{name}", self.root)
    }

    /// The node of the record of the eviction of `name`'s grant with token `czxid`.
    /// Twenty digits: a name's records sort by token.
    pub(crate) fn eviction(&self, name: &LockName, czxid: i64) -> String {
        format!("{}/{czxid:020}", self.evictions(name))
    }

    /// The node of `name`'s record under `key`.
    pub(crate) fn record(&self, name: &LockName, key: &RecordKey) -> String {
        format!("{}/{RECORDS}/{name}/{key}", self.root)
    }

    /// The lock whose directory is `path` or holds it (a contender or a marker).
    /// `None` for the root, the records and any other path that is no lock's.
    pub(crate) fn lock_at(&self, path: &str) -> Option<LockName> {
        let below = path.strip_prefix(&self.root)?.strip_prefix('/')?;
        let child = below.split_once('/').map_or(below, |(child, _)| child);
        lock_of(child).map(|(name, _)| name)
    }
}

/// The lock whose directory is the child `child` of the root, and whether it is the permit set's.
/// `None` for a child that is no lock's directory.
pub(crate) fn lock_of(child: &str) -> Option<(LockName, bool)> {
    let (name, permit) = match child.strip_suffix(PERMITS) {
        Some(name) => (name, true),
        None => (child, false),
    };
    Some((LockName::new(name).ok()?, permit))
}

/// The name (without the sequence number) of `owner`'s node in `mode`.
/// With `delayed` (the grant will have a lock-delay marker), a `d` follows the mode: a
/// waiter behind it knows that its deletion may leave the lock closed.
pub(crate) fn node_prefix(owner: &OwnerId, mode: Mode, delayed: bool) -> String {
    let delayed = if delayed { "d" } else { "" };
    format!("{owner}-{}{delayed}{LOCK_SUFFIX}", mode_token(mode))
}

/// The "sequence number" of every lock-delay marker, which puts it last in its queue.
/// It is higher than any ZooKeeper gives, and after every real one when compared as text
/// (Curator's way), so that a marker is always last in its directory's queue for any recipe
/// that counts it as a contender.
const MARKER_SEQ: &str = "9999999999";

/// The name of the lock-delay marker of `owner`'s grant, in its set's directory.
pub(crate) fn marker_name(owner: &OwnerId) -> String {
    format!("{owner}-m{LOCK_SUFFIX}{MARKER_SEQ}")
}

/// The owner of a lock-delay marker, if `child` is one.
pub(crate) fn marker_owner(child: &str) -> Option<OwnerId> {
    let owner = child
        .strip_suffix(MARKER_SEQ)?
        .strip_suffix(LOCK_SUFFIX)?
        .strip_suffix("-m")?;
    OwnerId::parse(owner).ok()
}

fn mode_token(mode: Mode) -> String {
    match mode {
        Mode::Exclusive => "x".into(),
        Mode::Shared => "s".into(),
        Mode::Permit { limit } => format!("p{limit}"),
    }
}

/// The owner, mode and lock-delay flag in a node name without its sequence number.
/// `None` unless [`node_prefix`] wrote it.
pub(crate) fn parse_node_prefix(head: &str) -> Option<(OwnerId, Mode, bool)> {
    let (owner, token) = head.strip_suffix(LOCK_SUFFIX)?.rsplit_once('-')?;
    let (token, delayed) = match token.strip_suffix('d') {
        Some(token) => (token, true),
        None => (token, false),
    };
    Some((OwnerId::parse(owner).ok()?, parse_mode(token)?, delayed))
}

fn parse_mode(token: &str) -> Option<Mode> {
    match token.as_bytes() {
        b"x" => Some(Mode::Exclusive),
        b"s" => Some(Mode::Shared),
        [b'p', limit @ ..] => {
            let limit = std::str::from_utf8(limit).ok()?;
            // No sign, no leading zeros: exactly what `mode_token` writes.
            if limit.starts_with(['0', '+']) {
                return None;
            }
            Some(Mode::Permit {
                limit: limit.parse::<NonZeroU32>().ok()?,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_markers_sort_last() {
        let owner = OwnerId::parse("1a2b-00ff").unwrap();
        let limit = NonZeroU32::new(3).unwrap();
        for mode in [Mode::Exclusive, Mode::Shared, Mode::Permit { limit }] {
            for delayed in [false, true] {
                let head = node_prefix(&owner, mode, delayed);
                let parsed = parse_node_prefix(&head).unwrap();
                assert_eq!(parsed, (owner.clone(), mode, delayed), "{head}");
                // Curator sorts by the text after the last "lock-": for ours, the sequence.
                let node = format!("{head}0000000012");
                assert_eq!(node.rsplit_once("lock-").unwrap().1, "0000000012");
            }
        }
        // Not ours: a mode token we never write.
        for odd in [
            "o-p0-lock-",
            "o-p03-lock-",
            "o-p+3-lock-",
            "o-q-lock-",
            "o-x-",
        ] {
            assert!(parse_node_prefix(odd).is_none(), "{odd}");
        }
        // Lock-delay markers sort last for Curator too.
        let marker = marker_name(&owner);
        assert_eq!(marker_owner(&marker).unwrap(), owner);
        let after = |n: &str| n.rsplit_once("lock-").unwrap().1.to_owned();
        assert!(after(&marker) > after(&format!("x-lock-{:019}", i64::MAX)));
        assert!(marker_owner("o-x-lock-0000000001").is_none());
    }

    #[test]
    fn the_roots_children_are_the_directories_of_locks() {
        let layout = Layout::new("leasehold");
        let name = LockName::new("jobs:1").unwrap();
        let limit = NonZeroU32::MIN;
        for (mode, permit) in [(Mode::Exclusive, false), (Mode::Permit { limit }, true)] {
            let dir = layout.dir(&name, mode);
            let child = dir.strip_prefix("/leasehold/").unwrap();
            assert_eq!(lock_of(child), Some((name.clone(), permit)), "{dir}");
        }
        for other in ["", "#permits", "a#b", "a/b", ".a"] {
            assert_eq!(lock_of(other), None, "{other}");
        }
        // The records' directory is no lock's, and no lock's directory holds records.
        let records = layout.records();
        assert_eq!(lock_of(records.strip_prefix("/leasehold/").unwrap()), None);
        let key = RecordKey::new("done:0000000001").unwrap();
        let record = layout.record(&name, &key);
        assert_eq!(record, "/leasehold/#records/jobs:1/done:0000000001");
        assert_eq!(
            record.rsplit_once('/').unwrap().0,
            layout.records_dir(name.as_str())
        );
        for mode in [Mode::Exclusive, Mode::Permit { limit }] {
            assert!(!record.starts_with(&format!("{}/", layout.dir(&name, mode))));
        }
    }

    #[test]
    fn a_watched_path_names_the_lock_it_belongs_to() {
        let layout = Layout::new("leasehold");
        let name = LockName::new("jobs:1").unwrap();
        let owner = OwnerId::parse("1a2b-00ff").unwrap();
        let limit = NonZeroU32::MIN;
        for mode in [Mode::Exclusive, Mode::Shared, Mode::Permit { limit }] {
            let dir = layout.dir(&name, mode);
            let node = format!("{dir}/{}0000000042", node_prefix(&owner, mode, false));
            let marker = format!("{dir}/{}", marker_name(&owner));
            for path in [&dir, &node, &marker] {
                assert_eq!(layout.lock_at(path).as_ref(), Some(&name), "{path}");
            }
        }
        let key = RecordKey::new("done:1").unwrap();
        for other in [
            "/leasehold".to_owned(),
            "/leasehold/".to_owned(),
            "/leaseholder/jobs:1".to_owned(),
            "/other/jobs:1".to_owned(),
            layout.records(),
            layout.records_dir(name.as_str()),
            layout.record(&name, &key),
        ] {
            assert_eq!(layout.lock_at(&other), None, "{other}");
        }
    }
}
