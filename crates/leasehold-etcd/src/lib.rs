//! leasehold's etcd backend: every grant committed by a Raft majority.
//!
//! - **One session per backend**: one lease, kept alive by a keep-alive stream, shared by
//!   every lock, permit and candidacy; guards follow the session and are lost when it ends
//!   (see `session.rs`). [`EtcdBackend::close`] revokes it,
//!   [`EtcdBackend::orphan`] stops renewing it.
//! - **Grant in one transaction**: into an empty queue, my key
//!   (`<prefix>/<name>/<set>/<lease>.<slot>`) is put bound to the session lease, with the
//!   owner in its value, and holds at the transaction's revision. Otherwise the same
//!   transaction puts it and reads the queue (the keys of the set, oldest first); if the
//!   put of an unanswered attempt already landed, the put again keeps the key's create
//!   revision, its place in the queue. A session reuses the slot numbers it freed: every new
//!   key would leave a deleted one behind that each queue read steps over until etcd
//!   compacts its history. The holder is the key with the lowest create revision (for
//!   shared keys: no exclusive key before it; for permits: fewer than N keys before it).
//!   The fencing token is the create revision of the holder's key, increasing cluster-wide.
//! - **Waiting**: watch only the deletion of the key that stands in my way (the one just
//!   before mine; for a reader the nearest writer before it), from the current revision — a
//!   watch from an older revision goes through etcd's catch-up loop and is delivered up to
//!   100 ms late — then look that key up once, for what happened before the watch was in
//!   place. After waking, the transaction confirms my key still exists under my live
//!   session before anything is granted; a waiter whose session ended while it waited is
//!   refused (never granted on a dead lease).
//! - **Release** deletes my key, and no newer one: a key is this session's and this slot's,
//!   only this process writes it, and a slot goes to a new acquisition only after the one
//!   delete sent for its previous key was answered; a slot whose delete failed, timed out or
//!   had to be sent again is retired for the rest of the session. A late or retried delete
//!   can never reach a newer key, so the delete needs no compare — which matters on etcd
//!   3.4, where any transaction costs the member more than a plain delete.
//! - **Lock-delay**: a grant with a lock-delay also puts a marker bound to a lease that
//!   outlives the session's by the delay; a marker whose holder's key is gone closes the
//!   queue until it expires; release deletes it with the key.
//!
//! URL: `etcd://[user:password@]host:port[,host:port...][?prefix=P&session_ttl=D&connect_timeout=D]`;
//! `etcds://…[&tls_ca=PATH&tls_cert=PATH&tls_key=PATH]` for TLS (each member's
//! certificate checked against its own host name; without `tls_ca`, the system's CA
//! certificates). See `docs/backends/etcd.md`.

mod backend;
mod connection;
mod error;
mod keys;
mod options;
mod reply;
mod requests;
mod session;
mod transport;

pub use connection::EtcdBackend;
pub use options::EtcdOptions;
