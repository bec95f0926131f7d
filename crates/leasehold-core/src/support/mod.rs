//! Helpers for backend implementors: who holds in a queue, who waits for a wake-up,
//! connections that stopped answering, TLS files, key prefixes, credentials kept out of
//! messages.

pub mod health;
mod prefix;
pub mod queue;
mod redact;
mod tls;
pub mod wakeups;

pub use prefix::check_key_prefix;
pub use redact::redact_url;
#[cfg(feature = "tls")]
pub use tls::ServerCheck;
pub use tls::TlsFiles;
