//! Helpers for backend implementors, one concern per module.
//!
//! The concerns: who holds in a queue, connections that stopped answering, URLs, TLS files,
//! key prefixes, credentials kept out of messages.

pub mod health;
mod prefix;
pub mod queue;
mod tls;
pub mod url;

pub use prefix::check_key_prefix;
pub use tls::TlsFiles;
#[doc(inline)]
pub use url::{Secret, redact_url, url_params};
