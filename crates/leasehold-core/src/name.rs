//! Lock names and owner ids.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// A validated lock name.
///
/// Names are checked once, here, so that every backend can map them to its keys, paths or
/// file names without escaping: 1 to [`LockName::MAX_LEN`] bytes of ASCII letters, digits
/// and `_ - . : @ + =`, not starting with `.`. Everything else is rejected rather than
/// escaped, so a name means the same thing on every backend:
///
/// - `/` would be a path separator for ZooKeeper and the file backend (use `:` to build
///   hierarchies, as in `orders:42`);
/// - `{` `}` would change the Redis Cluster hash tag of the lock's keys;
/// - `*` `?` `[` `]` are glob characters in Redis `SCAN`/`KEYS` patterns;
/// - `#` separates a name from internal key suffixes, so no name collides with them;
/// - whitespace, control characters and NUL are never what a user meant.
///
/// ```
/// use leasehold_core::LockName;
///
/// assert!(LockName::new("orders:42").is_ok());
/// assert!(LockName::new("").is_err());
/// assert!(LockName::new("jobs/nightly").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

impl LockName {
    /// The longest accepted name, in bytes.
    /// Short enough to be a file name with a suffix on every common file system.
    pub const MAX_LEN: usize = 200;

    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] saying which rule the name breaks.
    pub fn new(name: &str) -> Result<Self> {
        let reject = |reason: String| Err(Error::invalid("lock name", reason));
        if name.is_empty() {
            return reject("the name is empty".into());
        }
        if name.len() > Self::MAX_LEN {
            return reject(format!(
                "the name is {} bytes long; the limit is {}",
                name.len(),
                Self::MAX_LEN
            ));
        }
        if name.starts_with('.') {
            return reject(format!("{:?} starts with '.'", Self::preview(name)));
        }
        if let Some(bad) = name.chars().find(|c| !Self::allowed(*c)) {
            let hint = match bad {
                '/' => "; use ':' to build hierarchies, as in \"jobs:nightly\"",
                '{' | '}' => "; braces would change the Redis Cluster hash tag",
                _ => "",
            };
            return reject(format!(
                "{:?} contains {:?}; allowed are ASCII letters, digits and _ - . : @ + ={hint}",
                Self::preview(name),
                bad
            ));
        }
        Ok(Self(name.into()))
    }

    fn allowed(c: char) -> bool {
        c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '@' | '+' | '=')
    }

    /// At most 40 characters of a rejected name, so a 1 MiB name does not end up in a log.
    fn preview(name: &str) -> String {
        let mut preview: String = name.chars().take(40).collect();
        if preview.len() < name.len() {
            preview.push('…');
        }
        preview
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for LockName {
    type Error = Error;
    fn try_from(name: &str) -> Result<Self> {
        Self::new(name)
    }
}

/// The beginning of lock names, for listing the locks under it.
///
/// Checked like a [`LockName`] (the same characters, so no glob character reaches a Redis
/// `SCAN` pattern), except that it may be empty: the empty prefix lists every lock.
///
/// ```
/// use leasehold_core::{LockName, NamePrefix};
///
/// let jobs = NamePrefix::new("jobs:").unwrap();
/// assert!(jobs.matches(&LockName::new("jobs:nightly").unwrap()));
/// assert!(!jobs.matches(&LockName::new("orders:42").unwrap()));
/// assert!(NamePrefix::new("jobs*").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct NamePrefix(Arc<str>);

impl NamePrefix {
    /// Validates `prefix`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when no lock name could begin with it.
    pub fn new(prefix: &str) -> Result<Self> {
        if prefix.is_empty() {
            return Ok(Self::default());
        }
        LockName::new(prefix).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::invalid("name prefix", reason),
            other => other,
        })?;
        Ok(Self(prefix.into()))
    }

    /// Whether `name` begins with this prefix.
    pub fn matches(&self, name: &LockName) -> bool {
        name.as_str().starts_with(&*self.0)
    }

    /// The prefix as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for NamePrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The key of a record kept beside a lock name (see [`Backend::put_record`](crate::Backend::put_record)).
///
/// Checked like a [`LockName`] — the same characters, so every backend can put it into a
/// key, a path or a file name — but at most [`RecordKey::MAX_LEN`] bytes.
///
/// ```
/// use leasehold_core::RecordKey;
///
/// assert!(RecordKey::new("done:1795348800000+3600000").is_ok());
/// assert!(RecordKey::new("a/b").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey(Arc<str>);

impl RecordKey {
    /// The longest accepted key, in bytes.
    pub const MAX_LEN: usize = 100;

    /// Validates `key`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] saying which rule the key breaks.
    pub fn new(key: &str) -> Result<Self> {
        if key.len() > Self::MAX_LEN {
            return Err(Error::invalid(
                "record key",
                format!(
                    "the key is {} bytes long; the limit is {}",
                    key.len(),
                    Self::MAX_LEN
                ),
            ));
        }
        LockName::new(key).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::invalid("record key", reason),
            other => other,
        })?;
        Ok(Self(key.into()))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The identity of one acquisition, stored by the server as the holder's (or waiter's) value.
/// Every release and renewal is checked against it.
///
/// A fresh id is made for every acquisition: `<pid in hex>-<128 random bits in hex>`, so it
/// says which process holds a lock and never repeats. The first 32 of the random bits are
/// drawn once per process, so that `<pid>-<first 8 hex digits>` tells a process apart from
/// a later one that got the same pid (an auditor judges each process by its own events).
/// Only characters valid in a [`LockName`] are used, so backends can put an owner id into
/// keys and file names.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(Arc<str>);

impl OwnerId {
    /// A new, unique owner id: `<pid in hex>-<128 random bits in hex>`.
    /// The first 32 random bits are this process's, the other 96 the id's own.
    pub fn generate() -> Self {
        // The pid is only informative (uniqueness comes from the random bits); it is
        // written once per process with the process's random bits, and every id is made
        // from it without formatting (one is made per acquisition).
        static PREFIX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let prefix = PREFIX
            .get_or_init(|| format!("{:x}-{:08x}", std::process::id(), rand::random::<u32>()));
        let random: u128 = rand::random();
        let mut id = String::with_capacity(prefix.len() + 24);
        id.push_str(prefix);
        id.extend(
            (0..24)
                .map(|i| char::from(b"0123456789abcdef"[(random >> (92 - 4 * i)) as usize & 0xf])),
        );
        Self(id.into())
    }

    /// Wraps an owner id read back from a server.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] unless the id is 1 to 128 characters valid in a lock name.
    pub fn parse(id: &str) -> Result<Self> {
        if id.is_empty() || id.len() > 128 || !id.chars().all(LockName::allowed) {
            return Err(Error::invalid(
                "owner id",
                format!("{:?} is not an owner id", LockName::preview(id)),
            ));
        }
        Ok(Self(id.into()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The process id encoded in a generated owner id.
    pub fn pid(&self) -> Option<u32> {
        let (pid, _) = self.0.split_once('-')?;
        u32::from_str_radix(pid, 16).ok()
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(name: &str) -> String {
        match LockName::new(name) {
            Err(Error::InvalidArgument { what, reason }) => {
                assert_eq!(what, "lock name");
                reason
            }
            other => panic!("{name:?} was not rejected: {other:?}"),
        }
    }

    #[test]
    fn accepts_ordinary_names() {
        for name in [
            "a",
            "orders:42",
            "job_1.daily",
            "user@example.com",
            "x=1+2",
            "A-Z",
        ] {
            assert_eq!(LockName::new(name).unwrap().as_str(), name);
        }
        LockName::new(&"n".repeat(LockName::MAX_LEN)).unwrap();
    }

    #[test]
    fn rejects_bad_names_with_reasons() {
        assert!(reason("").contains("empty"));
        assert!(reason(" ").contains("' '"));
        assert!(reason("a b").contains("' '"));
        assert!(reason("a\0b").contains("\\0"));
        assert!(reason("a\nb").contains("\\n"));
        assert!(reason("jobs/nightly").contains("':'"));
        assert!(reason("{tag}").contains("hash tag"));
        assert!(reason("a*").contains('*'));
        assert!(reason("a?").contains('?'));
        assert!(reason("a[1]").contains('['));
        assert!(reason("a#lock").contains('#'));
        assert!(reason(".").contains("'.'"));
        assert!(reason("..").contains("'.'"));
        assert!(reason("é").contains('é'));
        let huge = "x".repeat(1 << 20);
        let r = reason(&huge);
        assert!(r.contains("1048576 bytes"), "{r}");
        assert!(
            r.len() < 200,
            "the reason quotes the whole name: {} bytes",
            r.len()
        );
    }

    #[test]
    fn owner_ids_are_unique_and_name_safe() {
        let a = OwnerId::generate();
        let b = OwnerId::generate();
        assert_ne!(a, b);
        assert_eq!(a.pid(), Some(std::process::id()));
        let (_, random) = a.as_str().split_once('-').unwrap();
        assert_eq!(random.len(), 32);
        assert!(random.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert!(a.as_str().chars().all(LockName::allowed));
        assert_eq!(OwnerId::parse(a.as_str()).unwrap(), a);
        assert!(OwnerId::parse("").is_err());
        assert!(OwnerId::parse("a/b").is_err());
    }
}
