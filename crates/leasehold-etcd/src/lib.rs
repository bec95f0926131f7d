//! leasehold's etcd backend: grants committed by a Raft majority, the same lock as etcd's.
//!
//! The crate, one concern per file:
//! - `lib.rs`: this map, how it works in brief, the exports;
//! - `options.rs`: options and URL parameters;
//! - `transport.rs`: the connection to one member at a time, with TLS;
//! - `rpc/mod.rs`: etcd's gRPC API: one handle that signs requests, transaction builders;
//! - `rpc/etcdserverpb.rs`: its messages and clients, generated from `proto/etcd.proto`;
//! - `connection.rs`: the backend value, connecting, the session in use;
//! - `session.rs`: the session lease, its keep-alives, liveness, fence; lock-delay, unkept leases;
//! - `layout.rs`: where entries (keys) live and how they are named;
//! - `registry.rs`: the entries this client has placed, by owner, and the slots of kept keys;
//! - `requests.rs`: the transactions: acquire, remove, put a marker, put a record, keep, read;
//! - `reply.rs`: what keys say: values, the queue a read returns, tokens;
//! - `error.rs`: etcd errors as leasehold errors;
//! - `changes.rs`: the change feed of a name prefix: one watch, watched again after a break;
//! - `grants.rs`: the watch of this client's grants, which hears of their eviction;
//! - `backend.rs`: the [`Backend`](leasehold_core::Backend) implementation.
//!
//! How it works:
//!
//! - **One session per backend**: one lease, kept alive by a keep-alive stream, shared by
//!   every lock, permit and candidacy; guards follow the session and are lost when it ends
//!   (`session.rs`). [`EtcdBackend::close`] revokes it, [`EtcdBackend::orphan`] stops
//!   renewing it.
//! - **Keys where etcd's lock recipe puts them** (`layout.rs`): the exclusive and shared
//!   contenders of lock `N` are `N/<lease>.<slot>` (under `<prefix>/` with a prefix), the
//!   directory etcd's `concurrency.Mutex` — `etcdctl lock N`, the Lock RPC — uses. Both
//!   order contenders by create revision and the oldest holds, so each excludes the other;
//!   a key there that is not ours is an exclusive contender (`reply.rs`). Permits and
//!   lock-delay markers live beside it, under `N#permits/` and `N#delay/`, which no Mutex
//!   reads.
//! - **Grant in one transaction** (`requests.rs`): into an empty queue, my key is put bound
//!   to the session lease, with the owner in its value, and holds at the transaction's
//!   revision. Otherwise a nested transaction puts it and reads the queue; if the put of an
//!   unanswered attempt already landed, the put again keeps the key's create revision, its
//!   place in the queue. The fencing token is the holder key's create revision.
//! - **No put outlives its acquisition**: every put compares the mod revision of the
//!   session's fence key (`#sessions/<lease>`). An acquisition that sent a put whose
//!   answer never came moves the fence in the transaction that removes its key, so that
//!   put — held up in a paused member, say — can no longer land and leave a key nobody
//!   owns.
//! - **Every removal is compared on the server**: a release or a withdrawal deletes my key
//!   only if its create revision is the one an answer showed (or, when no answer showed it,
//!   its value, which names the acquisition). A late or retried delete never removes a
//!   newer key, so a session reuses the slot numbers it freed at once: a new key per
//!   acquisition would leave a deleted one behind that every queue read steps over until
//!   etcd compacts its history.
//! - **Waiting**: watch only the deletion of the key that stands in my way (the one just
//!   before mine, etcd's or ours; for a reader the nearest writer before it), from the
//!   current revision — a watch from an older revision goes through etcd's catch-up loop
//!   and is delivered up to 100 ms late — then look that key up once, for what happened
//!   before the watch was in place. After waking, the transaction confirms my key still
//!   exists before anything is granted: a waiter whose session ended is refused.
//! - **The session is suspended while its link is down** (a keep-alive unanswered for a
//!   tenth of the ttl, its stream broken): its guards stay held until the same deadline,
//!   and a release that fails meanwhile is retried until the link is back.
//! - **Watching locks** (`changes`): one watch per feed on the key range of the name
//!   prefix, from the revision at which etcd created it; each event names the lock its key
//!   belongs to. A broken or canceled watch is watched again and the feed told to resync.
//! - **A release that cannot be confirmed under a healthy session ends the session**
//!   ([`Backend::abandon`](leasehold_core::Backend::abandon)): its key is bound to the
//!   session's lease, so the session is revoked (or no longer kept alive) and later grants
//!   get a new one; its other guards are lost with it, and say so.
//! - **Lock-delay**: a grant with a lock-delay also puts a marker bound to a lease that
//!   outlives the session's by the delay; a marker whose holder's key is gone closes the
//!   queue until it expires; release deletes it with the key.
//! - **Force release** (`evict`): one transaction compares the holder's key's create
//!   revision (its token) and deletes it, puts a marker of the evicted owner bound to a
//!   lease of the holder's session ttl (the queue stays closed until the holder's session
//!   deadline has passed) and the eviction record `#evictions/<name>/<token>`. The holder's
//!   client watches each granted key (`grants.rs`: one stream, one watch per key) and
//!   revokes the grant whose key another client deleted: `Evicted` when the record names it.
//! - **Records beside a lock** live under `#records/<name>/<key>`, apart from every
//!   name's keys, each bound to a lease of its own of the time it is kept. One transaction
//!   compares the writer's key (its create revision) and puts the record; a read is
//!   linearizable.
//! - **A kept grant** (`keep`) moves its key off the session onto a lease of its own, of
//!   the time it is held, in one transaction that compares the key; the put keeps its
//!   create revision (its place, its token). etcd deletes it when that lease runs out,
//!   whatever becomes of the session; until a read shows it gone, its slot is not reused.
//!
//! URL: `etcd://[user:password@]host:port[,host:port...][?prefix=P&session_ttl=D&drift_margin=D&connect_timeout=D]`;
//! `etcds://…[&tls_ca=PATH&tls_cert=PATH&tls_key=PATH]` for TLS (each member's
//! certificate checked against its own host name; without `tls_ca`, the system's CA
//! certificates). See [`EtcdOptions`] and `docs/backends/etcd.md`.

mod backend;
mod changes;
mod connection;
mod error;
mod grants;
mod layout;
mod options;
mod registry;
mod reply;
mod requests;
mod rpc;
mod session;
mod transport;

pub use connection::{EtcdBackend, StillOwner};
pub use options::EtcdOptions;
