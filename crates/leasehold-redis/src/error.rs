//! Redis errors as leasehold errors.

use std::fmt::Display;
use std::sync::Arc;

use leasehold_core::Error;
use redis::RedisError;

/// Maps a Redis error to a leasehold error, without credentials.
/// `name` is the lock (or what was being done) for the message.
pub(crate) fn map_error(error: RedisError, name: impl Display) -> Error {
    if is_link_error(&error) {
        return Error::Unavailable {
            message: format!("redis: {error}"),
            source: Some(Arc::new(error)),
        };
    }
    let code = error.code().unwrap_or("");
    let retryable = matches!(
        code,
        "READONLY"
            | "LOADING"
            | "BUSY"
            | "TRYAGAIN"
            | "MASTERDOWN"
            | "CLUSTERDOWN"
            | "MOVED"
            | "ASK"
    );
    let message = match code {
        "READONLY" => "the server is a read-only replica; point leasehold at the primary".into(),
        "LOADING" => "the server is still loading its dataset".into(),
        "BUSY" => "the server is busy running a script".into(),
        "OOM" => "the server is out of memory and refuses writes".into(),
        "NOAUTH" | "WRONGPASS" => "authentication failed".into(),
        "NOPERM" => {
            "this user may not run leasehold's commands (EVALSHA, PUBLISH, SUBSCRIBE, WAIT)".into()
        }
        "WRONGTYPE" => format!(
            "a key of lock {name} holds data of another type; it was not written by leasehold"
        ),
        "LEASEHOLD_FOREIGN" => error
            .detail()
            .unwrap_or("foreign value under a lock key")
            .into(),
        "MOVED" | "ASK" => format!(
            "lock {name}'s slot is served by another node ({code} {}): a Redis Cluster (connect \
             with redis+cluster://) whose slot map changed faster than the client followed",
            error.detail().unwrap_or("?")
        ),
        "TRYAGAIN" => format!("lock {name}'s slot is moving between Redis Cluster nodes"),
        "CLUSTERDOWN" => "the Redis Cluster is down (a slot has no master)".into(),
        "CROSSSLOT" => format!("the keys of lock {name} are not in one slot"),
        _ => error.to_string(),
    };
    Error::Backend {
        message: format!("redis: {message}"),
        retryable,
        source: Some(Arc::new(error)),
    }
}

/// Whether `error` is the link's, not the server's answer: refused, dropped, I/O.
pub(crate) fn is_link_error(error: &RedisError) -> bool {
    error.is_connection_refusal() || error.is_io_error() || error.is_connection_dropped()
}

/// A reply that does not have the form leasehold's scripts give.
/// It is not retryable: it means the server runs something else under these names.
pub(crate) fn unexpected(what: &str, reply: impl std::fmt::Debug) -> Error {
    Error::backend(
        format!("redis: unexpected reply to {what}: {reply:?}"),
        false,
    )
}
