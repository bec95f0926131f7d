//! ZooKeeper's errors in leasehold's terms.

use std::sync::Arc;

use leasehold_core::Error;
use zookeeper_client as zk;

/// Maps a client error met while `doing` something.
/// Messages never carry credentials (the client's errors do not contain them).
pub(crate) fn map(error: zk::Error, doing: &str) -> Error {
    use zk::Error as E;
    let mut message = format!("zookeeper: {doing}: {error}");
    // `None`: an unknown outcome or a lost session, which the next request may not meet.
    let retryable = match error {
        // The request may or may not have been applied: an unknown outcome. The client
        // fails the requests in flight with a custom error when it gives the connection
        // up (no byte from the server for 2/5 of the session timeout, a broken socket).
        E::ConnectionLoss | E::Timeout | E::NoHosts | E::Custom(_) => None,
        // The session is gone: a new one is started for the next request.
        E::SessionExpired | E::SessionMoved | E::ClientClosed => None,
        E::NoAuth | E::AuthFailed => {
            message.push_str(" (check the URL's credentials and the ACL of the lock's path)");
            Some(false)
        }
        E::Throttled => Some(true),
        _ => Some(false),
    };
    let source = Some(Arc::new(error) as _);
    match retryable {
        None => Error::Unavailable { message, source },
        Some(retryable) => Error::Backend {
            message,
            retryable,
            source,
        },
    }
}

/// Whether the error says the session can no longer be used.
pub(crate) fn ends_session(error: &zk::Error) -> bool {
    matches!(
        error,
        zk::Error::SessionExpired
            | zk::Error::SessionMoved
            | zk::Error::ClientClosed
            | zk::Error::AuthFailed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_outcomes_are_retryable_and_refusals_are_not() {
        assert!(map(zk::Error::ConnectionLoss, "x").is_unknown_outcome());
        assert!(map(zk::Error::SessionExpired, "x").is_retryable());
        assert!(map(zk::Error::Throttled, "x").is_retryable());
        let refused = map(zk::Error::NoAuth, "creating /leasehold/a");
        assert!(!refused.is_retryable());
        assert!(refused.to_string().contains("ACL"), "{refused}");
        assert!(!map(zk::Error::BadVersion, "x").is_retryable());
        assert!(ends_session(&zk::Error::SessionExpired));
        assert!(!ends_session(&zk::Error::ConnectionLoss));
    }
}
