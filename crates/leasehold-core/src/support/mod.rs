//! Helpers for backend implementors.
//! Who holds in a queue, connections that stopped answering, TLS files, key prefixes,
//! credentials kept out of messages.

pub mod health;
mod prefix;
pub mod queue;
mod redact;
mod tls;

pub use prefix::check_key_prefix;
pub use redact::redact_url;
pub use tls::TlsFiles;
