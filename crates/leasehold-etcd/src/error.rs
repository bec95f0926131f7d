//! etcd's gRPC statuses as leasehold errors.

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::Error;
use tonic::{Code, Status};

/// Maps the status of a failed request, without credentials.
/// Unreachable members are [`Error::Unavailable`] (retryable), a deadline is
/// [`Error::Timeout`] (unknown outcome), anything else [`Error::Backend`].
pub(crate) fn map_error(status: Status, doing: &str) -> Error {
    let code = status.code();
    let message = format!("etcd: {doing}: {}", status.message());
    match code {
        // A channel that cannot connect answers `Unknown` ("Service was not ready").
        Code::Unavailable | Code::Cancelled | Code::Unknown => Error::Unavailable {
            message,
            source: Some(Arc::new(status)),
        },
        Code::DeadlineExceeded => Error::Timeout(Duration::ZERO),
        _ => Error::Backend {
            message,
            retryable: matches!(code, Code::ResourceExhausted | Code::Aborted),
            source: Some(Arc::new(status)),
        },
    }
}
