//! The one error type of leasehold.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Why a held lease stopped being trustworthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// The local deadline passed without a successful renewal.
    /// The server was unreachable, paused or too slow, or this process was paused.
    Expired,
    /// The server answered that the lock is no longer ours.
    /// It expired there, was force-released, or the server lost its data.
    NotOwner,
    /// The session the grant was bound to ended (etcd lease, ZooKeeper session).
    SessionEnded,
    /// The configured maximum hold time ran out, so renewal stopped.
    MaxHoldReached,
    /// The session's link went down and no keep-alive got through before the local deadline.
    /// The guard was suspended, and ZooKeeper's jeopardy turned into loss.
    Disconnected,
    /// An operator force-released the lock (`leasehold release --force`).
    /// The eviction record (who, when, why) is in the lock's
    /// [`LockState::evictions`](crate::LockState::evictions).
    Evicted,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::Expired => "the lease deadline passed without a renewal",
            LossReason::NotOwner => "the server no longer records this owner as holder",
            LossReason::SessionEnded => "the session holding the lease ended",
            LossReason::MaxHoldReached => "the maximum hold time was reached",
            LossReason::Disconnected => {
                "the session was disconnected and not restored before the lease deadline"
            }
            LossReason::Evicted => "an operator force-released the lock",
        })
    }
}

/// Errors of every leasehold operation.
///
/// Contention is not an error: `try_lock` and friends return `Ok(None)` when someone else
/// holds the lock. Backends keep their own error details private and convert into these
/// variants.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument was rejected before anything was sent: a bad name, duration, URL or topology.
    /// Nothing changed on any server.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// What was invalid ("lock name", "ttl", "url", ...).
        what: &'static str,
        /// Why, in words a user can act on.
        reason: String,
    },

    /// The guard had already lost its lease when this operation ran.
    #[error("lock lost: {0}")]
    Lost(LossReason),

    /// The server holds no grant (and no queue entry) for this owner.
    /// It was already released, or it expired and nobody noticed until now.
    #[error("the lock is not held by this owner")]
    NotHeld,

    /// The backend cannot do what was asked.
    #[error("{feature} is not supported by the {backend} backend")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// The feature that was asked for.
        feature: &'static str,
    },

    /// The server did not answer in time.
    /// The outcome of the request is unknown: it may or may not have been applied.
    #[error("no answer from the backend within {0:?}; the outcome is unknown")]
    Timeout(Duration),

    /// The backend could not be reached (connection refused, reset, DNS, ...).
    /// Retrying later may help.
    #[error("backend unavailable: {message}")]
    Unavailable {
        /// What happened, with credentials redacted.
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },

    /// The backend answered with an error.
    /// A read-only replica, out of memory, unexpected data under a lock key, …
    #[error("backend error: {message}")]
    Backend {
        /// What happened, with credentials redacted.
        message: String,
        /// Whether the same request may succeed if retried.
        retryable: bool,
        /// The underlying error, if any.
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
}

impl Error {
    /// An [`Error::InvalidArgument`].
    pub fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            what,
            reason: reason.into(),
        }
    }

    /// An [`Error::Unavailable`] without a source.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Error::Unavailable {
            message: message.into(),
            source: None,
        }
    }

    /// An [`Error::Backend`] without a source.
    pub fn backend(message: impl Into<String>, retryable: bool) -> Self {
        Error::Backend {
            message: message.into(),
            retryable,
            source: None,
        }
    }

    /// Whether the same operation may succeed if tried again.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout(_) | Error::Unavailable { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// Whether the request may or may not have been applied on the server.
    /// It timed out, or the connection failed and nobody can tell whether the request went
    /// out.
    ///
    /// An acquire with an unknown outcome must be resolved (adopted or released by owner),
    /// never ignored; leasehold's engine does this itself.
    pub fn is_unknown_outcome(&self) -> bool {
        matches!(self, Error::Timeout(_) | Error::Unavailable { .. })
    }
}

/// `Result<T, leasehold_core::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
