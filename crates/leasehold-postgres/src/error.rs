//! tokio-postgres errors as leasehold errors.
//!
//! | PostgreSQL says | leasehold error | why |
//! |---|---|---|
//! | the connection broke, or never came up | [`Error::Unavailable`] | the outcome is unknown; the engine resolves it by owner id |
//! | 57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now, 57P05 idle session timeout | [`Error::Unavailable`] | the server ended the session; another may work |
//! | 40P01 deadlock, 40001 serialization failure, 55P03 lock not available, 57014 query cancelled, 53300 too many connections | [`Error::Backend`], retryable | the statement was rolled back; trying again may succeed |
//! | 25006 read-only transaction | [`Error::Backend`], retryable | connected to a standby; after a failover a new connection may reach the primary |
//! | anything else (privileges, missing objects, bad data) | [`Error::Backend`], not retryable | trying again will not help |

use std::sync::Arc;

use leasehold_core::Error;
use tokio_postgres::error::SqlState;

/// Maps `error` from `doing` (e.g. "acquire") into a leasehold error.
pub(crate) fn map(error: tokio_postgres::Error, doing: &str) -> Error {
    let Some(db) = error.as_db_error() else {
        let message = format!("postgres: {doing}: {}", with_causes(&error));
        return if error.is_closed() || io_source(&error) {
            Error::Unavailable {
                message,
                source: Some(Arc::new(error)),
            }
        } else {
            Error::Backend {
                message,
                retryable: false,
                source: Some(Arc::new(error)),
            }
        };
    };
    let code = db.code().clone();
    let message = format!(
        "postgres: {doing}: {} ({}): {}",
        db.severity(),
        code.code(),
        db.message()
    );
    let source: Option<Arc<dyn std::error::Error + Send + Sync>> = Some(Arc::new(error));
    match classify(&code) {
        Class::SessionEnded => Error::Unavailable { message, source },
        Class::RolledBack => Error::Backend {
            message,
            retryable: true,
            source,
        },
        Class::Permanent => Error::Backend {
            message,
            retryable: false,
            source,
        },
    }
}

/// What an SQLSTATE means for the request that got it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// The server ended the session (or would not start one).
    SessionEnded,
    /// The statement was rolled back for a reason that may pass.
    RolledBack,
    /// Trying again will not help.
    Permanent,
}

pub(crate) fn classify(code: &SqlState) -> Class {
    if [
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
        SqlState::CANNOT_CONNECT_NOW,
        SqlState::IDLE_SESSION_TIMEOUT,
    ]
    .contains(code)
    {
        Class::SessionEnded
    } else if [
        SqlState::T_R_DEADLOCK_DETECTED,
        SqlState::T_R_SERIALIZATION_FAILURE,
        SqlState::LOCK_NOT_AVAILABLE,
        SqlState::QUERY_CANCELED,
        SqlState::TOO_MANY_CONNECTIONS,
        SqlState::READ_ONLY_SQL_TRANSACTION,
    ]
    .contains(code)
    {
        Class::RolledBack
    } else {
        Class::Permanent
    }
}

/// The error and its causes, as `a: b: c`.
/// tokio-postgres's own message leaves out why a handshake or a connection failed.
fn with_causes(error: &tokio_postgres::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// Whether an I/O error is somewhere in the chain (a broken or refused connection).
fn io_source(error: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if cause.is::<std::io::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// A reply that does not have the shape a statement promises.
pub(crate) fn undecodable(doing: &str, what: impl std::fmt::Display) -> Error {
    Error::backend(
        format!("postgres: {doing}: the reply did not decode: {what}"),
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified() {
        for (code, class) in [
            ("57P01", Class::SessionEnded),
            ("57P02", Class::SessionEnded),
            ("57P03", Class::SessionEnded),
            ("57P05", Class::SessionEnded),
            ("40P01", Class::RolledBack),
            ("40001", Class::RolledBack),
            ("55P03", Class::RolledBack),
            ("57014", Class::RolledBack),
            ("25006", Class::RolledBack),
            ("53300", Class::RolledBack),
            ("42501", Class::Permanent),
            ("42P01", Class::Permanent),
            ("23505", Class::Permanent),
        ] {
            assert_eq!(classify(&SqlState::from_code(code)), class, "{code}");
        }
    }
}
