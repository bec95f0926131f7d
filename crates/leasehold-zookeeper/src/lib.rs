//! leasehold's ZooKeeper backend: ephemeral sequential nodes on one session.
//!
//! The crate, one concern per file:
//! - `lib.rs`: this map, how it works in brief, the exports;
//! - `options.rs`: options and URL parameters;
//! - `connection.rs`: the backend value, connecting, the session in use, the epoch check;
//! - `session.rs`: one session, its probes and liveness, and its lock-delay sessions;
//! - `layout.rs`: where entries (nodes) live and how they are named;
//! - `registry.rs`: the entries this client has placed, by owner, and their states;
//! - `requests.rs`: node requests: create and list, adopt, sweep, owner-checked delete;
//! - `reply.rs`: what a listing says: the queue, who holds, whom a waiter watches;
//! - `markers.rs`: lock-delay markers;
//! - `records.rs`: records beside a lock: the write fenced by the grant's node, the sweep;
//! - `changes.rs`: the change feed: a persistent recursive watch on the root;
//! - `grants.rs`: the watch of this client's grants, which hears of their eviction;
//! - `evict.rs`: force release: the `multi` that evicts a grant, its marker and record;
//! - `error.rs`: ZooKeeper errors as leasehold errors;
//! - `backend.rs`: the [`Backend`](leasehold_core::Backend) implementation.
//!
//! How it works:
//!
//! - **One session per backend** serves every lock, permit and candidacy (see
//!   `docs/backends/zookeeper.md`): guards follow it — *suspended* while its link is down,
//!   lost at the local deadline (when the leader is known to have last heard from the
//!   session, from probes that are `sync`s, plus the negotiated session timeout, minus a
//!   drift allowance), before the leader can expire it and let another client in.
//!   [`ZooKeeperBackend::close`] closes it.
//! - **Grant in one round trip**: the create of my node (EPHEMERAL_SEQUENTIAL,
//!   `<dir>/<owner>-<mode>-lock-`) and the listing of the directory go out back to back (a
//!   session's requests are answered in order, so the listing shows my node); the parent
//!   directories are created only when the create fails for want of them. The lowest
//!   sequence holds (for readers: no writer before them; for permits: the first N). The
//!   fencing token is my node's czxid: strictly increasing in grant order within each set
//!   of a name (locks; permits), not across the two.
//! - **Waiting** watches only the node in the way (the one just before mine; for a reader
//!   the nearest writer before it), never the directory, and lists again when it goes.
//! - **Protection mode**: the owner id in the node's name finds the node of a create whose
//!   reply was lost; it is adopted (or deleted by the release).
//! - **Release** deletes my node by its path (which only this acquisition's owner id names)
//!   and its version.
//! - **Lock-delay**: a grant with a lock-delay also creates an ephemeral marker owned by a
//!   second session whose timeout is longer by the delay (rounded up to one of a few steps
//!   per doubling); a marker whose owner has no node left closes the lock until that
//!   session expires; release deletes it with the node.
//! - **Records** beside a lock are persistent nodes under `/<prefix>/#records/<name>`,
//!   written in one `multi` with a check that the writer's node exists, kept at least
//!   their keep by the leader's clock and swept by later writes (no TTL nodes).
//!   Grants cannot be kept past their holder: they are ephemeral nodes of its session.
//! - **Force release** (`evict`): one `multi` deletes the holder's node at the version read
//!   (its czxid the token), creates the evicted owner's lock-delay marker on a session the
//!   server expires after the holder's session timeout (each session says its timeout in
//!   `#sessions/<id>`), and the eviction record. The holder's
//!   client watches each granted node (`grants`: one-shot `exists` watches, one task) and
//!   revokes the grant whose node another client deleted: `Evicted` when the record names it.
//! - **Watching**: a change feed is one persistent recursive watch (`addWatch`) on the
//!   root, on the backend's session; each node event names its lock. A reconnection or a
//!   new session (the watch set again) is followed by a resync.
//! - **Interop**: Apache Curator's InterProcessMutex on the same path takes part in the
//!   same queue (see the node layout in
//!   `docs/backends/zookeeper.md`).
//!
//! URL: `zk://[user:password@]host:port[,host:port...][/chroot][?session_timeout=D&connect_timeout=D&prefix=P]`.
//! See `docs/backends/zookeeper.md`.

mod backend;
mod changes;
mod connection;
mod error;
mod evict;
mod grants;
mod layout;
mod markers;
mod options;
mod records;
mod registry;
mod reply;
mod requests;
mod session;

pub use connection::ZooKeeperBackend;
pub use options::ZooKeeperOptions;
