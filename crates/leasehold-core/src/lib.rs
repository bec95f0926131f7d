//! leasehold-core: the lock API and the engine every leasehold backend plugs into.
//!
//! - [`Client`] — a backend, a clock and default options; makes [`Mutex`], [`RwLock`],
//!   [`Semaphore`] and [`Election`] handles, and [`MultiLock`]s of several locks.
//! - [`Guard`] — proof of holding: [`token`](Guard::token), [`lost`](Guard::lost),
//!   [`remaining`](Guard::remaining), [`release`](Guard::release), [`run`](Guard::run).
//! - [`backend::Backend`] — the narrow trait a lock server implements.
//! - [`memory::InMemory`] — the reference backend, in process.
//! - [`fencing::Fence`] — the resource-side token check, in process.
//! - [`support`] — helpers for backend implementors (the queue rule, the per-name wake-up
//!   board, stalled connections, URLs, TLS files and, with the `tls` feature, their rustls
//!   configuration, key prefixes, redaction).
//! - [`telemetry`] — the metrics every lock reports (through the `metrics` facade).
//! - `clock::ManualClock` — time moved by hand (with the `test-util` feature); fault
//!   injection around any backend is the testkit's `Faulty`.
//!
//! Everything is built once, on one engine: waiting, fairness, reentrancy, the watchdog,
//! loss signals and scoped runs behave the same on every backend.
//!
//! ```
//! use leasehold_core::{Client, memory::InMemory};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold_core::Result<()> {
//! let client = Client::new(InMemory::new());
//! let guard = client.mutex("reports")?.lock().await?;
//! let token = guard.token(); // send with every write to the protected resource
//! # let _ = token;
//! guard.release().await?;
//! # Ok(()) }
//! ```

pub mod backend;
mod client;
pub mod clock;
mod context;
mod engine;
mod error;
pub mod events;
pub mod fencing;
mod lease;
pub mod memory;
mod name;
mod options;
mod release;
pub mod support;
pub mod sync;
pub mod telemetry;
mod watchdog;
mod watching;

pub use backend::{
    Backend, Capabilities, Change, Changes, Eviction, ListCursor, Listing, LockState, Mode,
};
pub use client::{Client, ClientBuilder};
pub use error::{Error, LossReason, Result};
pub use fencing::{Fence, FencingToken, StaleToken};
pub use name::{LockName, NamePrefix, OwnerId, RecordKey};
pub use options::{
    ConnectOptions, DEFAULT_TTL, LockOptions, LockOptionsBuilder, MAX_DURATION, parse_duration,
};
pub use sync::{
    Claim, Completion, Election, Guard, Job, JobRun, JobTicket, Leader, Leadership, MultiGuard,
    MultiLock, Mutex, MutexGuard, Observer, Outcome, Owner, Part, Permit, ReadGuard, RwLock,
    Semaphore, Window, WriteGuard,
};
pub use watching::{LockChange, LockWatch};
