//! Helpers for backend implementors: TLS files, key prefixes, credentials kept out of
//! messages.

mod prefix;
mod redact;
mod tls;

pub use prefix::check_key_prefix;
pub use redact::redact_url;
pub use tls::TlsFiles;
