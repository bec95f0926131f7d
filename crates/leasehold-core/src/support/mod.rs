//! Helpers for backend implementors: who holds in a queue, who waits for a wake-up,
//! connections that stopped answering, TLS files (and, with the `tls` feature, their rustls
//! configuration), key prefixes, credentials kept out of messages.

#[cfg(feature = "tls")]
mod client_tls;
pub mod health;
mod prefix;
pub mod queue;
mod redact;
mod tls;
pub mod wakeups;

#[cfg(feature = "tls")]
pub use client_tls::ServerCheck;
pub use prefix::check_key_prefix;
pub use redact::redact_url;
pub use tls::TlsFiles;
