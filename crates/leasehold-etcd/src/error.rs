//! etcd-client errors as leasehold errors.

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::Error;
use tonic::Code;

/// Maps an etcd-client error, without credentials.
/// Unreachable members are [`Error::Unavailable`] (retryable), a deadline is
/// [`Error::Timeout`] (unknown outcome), anything else [`Error::Backend`].
pub(crate) fn map_error(error: etcd_client::Error, doing: &str) -> Error {
    use etcd_client::Error as E;
    match &error {
        E::GRpcStatus(status) => {
            let code = status.code();
            let message = format!("etcd: {doing}: {}", status.message());
            match code {
                Code::Unavailable | Code::Cancelled | Code::Unknown => Error::Unavailable {
                    message,
                    source: Some(Arc::new(error)),
                },
                Code::DeadlineExceeded => Error::Timeout(Duration::ZERO),
                _ => Error::Backend {
                    message,
                    retryable: matches!(code, Code::ResourceExhausted | Code::Aborted),
                    source: Some(Arc::new(error)),
                },
            }
        }
        E::TransportError(_) | E::IoError(_) => Error::Unavailable {
            message: format!("etcd: {doing}: {error}"),
            source: Some(Arc::new(error)),
        },
        _ => Error::Backend {
            message: format!("etcd: {doing}: {error}"),
            retryable: false,
            source: Some(Arc::new(error)),
        },
    }
}
