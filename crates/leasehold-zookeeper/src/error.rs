//! ZooKeeper's errors in leasehold's terms.

use std::sync::Arc;

use leasehold_core::Error;
use zookeeper_client as zk;

/// Maps a client error met while `doing` something.
/// Messages never carry credentials (the client's errors do not contain them).
pub(crate) fn map(error: zk::Error, doing: &str) -> Error {
    use zk::Error as E;
    let message = format!("zookeeper: {doing}: {error}");
    match error {
        // The request may or may not have been applied: an unknown outcome. The client
        // fails the requests in flight with a custom error when it gives the connection
        // up (no byte from the server for 2/5 of the session timeout, a broken socket).
        E::ConnectionLoss | E::Timeout | E::NoHosts | E::Custom(_) => Error::Unavailable {
            message,
            source: Some(Arc::new(error)),
        },
        // The session is gone: a new one is started for the next request.
        E::SessionExpired | E::SessionMoved | E::ClientClosed => Error::Unavailable {
            message,
            source: Some(Arc::new(error)),
        },
        E::NoAuth | E::AuthFailed => Error::Backend {
            message: format!(
                "{message} (check the URL's credentials and the ACL of the lock's path)"
            ),
            retryable: false,
            source: Some(Arc::new(error)),
        },
        E::Throttled => Error::Backend {
            message,
            retryable: true,
            source: Some(Arc::new(error)),
        },
        _ => Error::Backend {
            message,
            retryable: false,
            source: Some(Arc::new(error)),
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
