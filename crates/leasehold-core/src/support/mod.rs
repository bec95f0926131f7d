//! Helpers for backend implementors, one concern per module.
//!
//! The concerns: who holds in a queue, who waits for a wake-up, connections that stopped
//! answering, URLs, TLS files (and, with the `tls` feature, their rustls configuration),
//! key prefixes, credentials kept out of messages, eviction records.

#[cfg(feature = "tls")]
mod client_tls;
pub mod evictions;
pub mod health;
mod prefix;
pub mod queue;
mod tls;
pub mod url;
pub mod wakeups;

#[cfg(feature = "tls")]
pub use client_tls::ServerCheck;
pub use prefix::check_key_prefix;
pub use tls::TlsFiles;
#[doc(inline)]
pub use url::{Secret, redact_url, url_params};
