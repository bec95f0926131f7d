//! Eviction records: how a force release is written beside its lock, and read back.
//!
//! `lua/evict.lua` pushes each record onto the name's list `<prefix>:{<name>}:evicted`,
//! newest first, and trims it to the last [`KEPT`]. The records are an audit trail, not
//! part of the lock: the list expires [`KEPT_FOR`] after the name's latest eviction, and
//! nothing else reads or waits on it. A renewal that finds its grant gone looks there to
//! tell an eviction from an expiry (`backend.rs`).
//!
//! A record is one string in the form every backend shares (see
//! [`leasehold_core::support::evictions`]); the scripts only store and return the strings.

pub(crate) use leasehold_core::support::evictions::{KEPT, KEPT_FOR, decode_all, encode};
