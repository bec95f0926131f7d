//! Records beside a lock: their nodes, the write fenced by the writer's grant, the sweep.
//!
//! A record is a persistent node `/<prefix>/#records/<name>/<key>` (see `layout`), apart
//! from every lock's directory. Its data is a header saying how long it is to be kept,
//! then the value: `leasehold-record keep=<ms>\n<value>`.
//!
//! - **Fenced write**: one `multi` checks that the grant's node exists and creates the
//!   record (or sets it, if the key has one already). A node once granted holds until it
//!   is deleted (the nodes ahead of it only go, later ones queue behind it), so its
//!   existence is the grant's; the multi applies both or neither.
//! - **Kept at least `keep`**: ZooKeeper keeps a node on a timer only as a TTL node, which
//!   a server creates only with `zookeeper.extendedTypesEnabled`. So a record is kept at
//!   least until its mtime (the leader's clock when it was written) plus its keep, and each
//!   write deletes records past that: a bounded sweep of the writer's name's others and of
//!   one other name's, in turn. A name's directory goes once it has no record left.

use std::time::Duration;

use futures_util::future::join_all;
use leasehold_core::backend::{MAX_RECORD_LEN, Request};
use leasehold_core::{Error, LockName, RecordKey, Result};
use zookeeper_client as zk;

use crate::connection::ZooKeeperBackend;
use crate::error::map;
use crate::registry::Stage;
use crate::reply::{Contender, or_empty};
use crate::session::Session;

/// How many times a write is tried while its record or its directory comes and goes.
const WRITE_ATTEMPTS: usize = 5;

/// How many records of one name a sweep reads at most.
const SWEEP: usize = 16;

/// What a record's data starts with; the keep in milliseconds and a newline follow.
const HEADER: &[u8] = b"leasehold-record keep=";

/// A record's data: the header with `keep`, then `value`.
fn encode(keep: Duration, value: &[u8]) -> Vec<u8> {
    let keep = keep_ms(keep).to_string();
    let mut data = Vec::with_capacity(HEADER.len() + keep.len() + 1 + value.len());
    data.extend_from_slice(HEADER);
    data.extend_from_slice(keep.as_bytes());
    data.push(b'\n');
    data.extend_from_slice(value);
    data
}

/// `keep` in whole milliseconds, rounded up (a record is kept at least `keep`).
fn keep_ms(keep: Duration) -> i64 {
    let part = u128::from(!keep.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(keep.as_millis().saturating_add(part)).unwrap_or(i64::MAX)
}

/// The keep (in milliseconds) and the value in a record's data.
/// `None` for data that [`encode`] did not write.
fn decode(data: &[u8]) -> Option<(i64, &[u8])> {
    let mut parts = data.strip_prefix(HEADER)?.splitn(2, |b| *b == b'\n');
    let (digits, value) = (parts.next()?, parts.next()?);
    // Exactly what `encode` writes: digits, no sign, no leading zero.
    if digits.is_empty()
        || !digits.iter().all(u8::is_ascii_digit)
        || (digits.len() > 1 && digits.first() == Some(&b'0'))
    {
        return None;
    }
    let keep = std::str::from_utf8(digits).ok()?.parse::<i64>().ok()?;
    Some((keep, value))
}

/// Whether a record written at `mtime` to be kept `keep` ms is past it at `now` (server times, ms).
fn expired(mtime: i64, keep: i64, now: i64) -> bool {
    mtime.saturating_add(keep) < now
}

impl ZooKeeperBackend {
    /// The live session and the node of `req`'s grant, if this client holds it.
    fn grant_node(&self, req: &Request) -> Option<(std::sync::Arc<Session>, String)> {
        let placed = self.registry().get(&req.owner)?;
        let (node, path) = placed.node_path()?;
        let ours = node.stage == Stage::Granted
            && placed.dir == self.inner.layout.dir(&req.name, req.mode)
            && Contender::parse(&node.name).is_some_and(|c| c.mode == req.mode);
        if !ours {
            return None;
        }
        let session = self
            .current()
            .filter(|s| s.id == placed.session && s.is_alive())?;
        Some((session, path))
    }

    /// Writes `value` under `key` beside `req.name` if `req`'s grant still holds.
    /// See [`Backend::put_record`](leasehold_core::Backend::put_record) and the module docs.
    /// `Ok(false)`: this client does not hold the grant, or its node is gone on the server.
    ///
    /// # Cancel safety
    ///
    /// Dropped after the multi went out, the record may or may not be written (only while
    /// the grant held); a dropped sweep leaves old records for the next write's.
    pub(crate) async fn put_record_node(
        &self,
        req: &Request,
        key: &RecordKey,
        value: &[u8],
        keep: Duration,
    ) -> Result<bool> {
        if value.len() > MAX_RECORD_LEN {
            return Err(Error::invalid(
                "record",
                format!("{} bytes; the limit is {MAX_RECORD_LEN}", value.len()),
            ));
        }
        let Some((session, grant)) = self.grant_node(req) else {
            return Ok(false);
        };
        let client = &session.client;
        let path = self.inner.layout.record(&req.name, key);
        let data = encode(keep, value);
        let options = self.create_options(zk::CreateMode::Persistent);
        // Most keys are new (a job's windows): the create goes first.
        let mut create = true;
        for _ in 0..WRITE_ATTEMPTS {
            let mut multi = client.new_multi_writer();
            multi
                .add_check_version(&grant, -1)
                .and_then(|()| {
                    if create {
                        multi.add_create(&path, &data, &options)
                    } else {
                        multi.add_set_data(&path, &data, None)
                    }
                })
                .map_err(|e| map(e, "writing a record"))?;
            // The first operation that failed says why (the server reports the ones after
            // it as not tried).
            let (index, error) = match multi.commit().await {
                Ok(results) => {
                    let stat = results.into_iter().nth(1).and_then(|result| match result {
                        zk::MultiWriteResult::Create { stat, .. }
                        | zk::MultiWriteResult::SetData { stat } => Some(stat),
                        _ => None,
                    });
                    self.sweep_records(client, &req.name, key, &path, stat)
                        .await;
                    return Ok(true);
                }
                Err(zk::MultiWriteError::OperationFailed { index, source }) => (index, source),
                Err(zk::MultiWriteError::RequestFailed { source }) => {
                    return Err(map(source, "writing a record"));
                }
            };
            match (index, error) {
                // The grant's node is gone: the grant does not hold, nothing was written.
                (0, zk::Error::NoNode) => return Ok(false),
                // The key has a record: set it.
                (1, zk::Error::NodeExists) if create => create = false,
                // The key's record went (swept) since: create it.
                (1, zk::Error::NoNode) if !create => create = true,
                // The name's directory is missing (a container: the server deletes it
                // once empty), or the directory of every name's.
                (1, zk::Error::NoNode) => {
                    let dir = self.inner.layout.records_dir(req.name.as_str());
                    client
                        .mkdir(&dir, &self.create_options(zk::CreateMode::Container))
                        .await
                        .map_err(|e| map(e, &format!("creating {dir}")))?;
                }
                (_, error) => return Err(map(error, "writing a record")),
            }
        }
        Err(Error::backend(
            format!("zookeeper: {path} keeps coming and going; cannot write it"),
            true,
        ))
    }

    /// The record under `key` beside `name`, read on the session in use.
    ///
    /// No `sync` is needed: a session reads one server at a time, which applies the
    /// ensemble's changes in zxid order, and a session never sees older state than it has
    /// seen (it reconnects only to a server as recent). A grant that follows a release of
    /// `name` was seen on this session as the released node's deletion (a listing without
    /// it, or its watch firing), which the leader ordered after every record its holder
    /// wrote before releasing: so a read after the grant sees them. A read without a grant
    /// may be behind, which the contract allows.
    ///
    /// A record past its keep may still be returned (until a write sweeps it): the
    /// contract keeps records *at least* their keep.
    pub(crate) async fn get_record_node(
        &self,
        name: &LockName,
        key: &RecordKey,
    ) -> Result<Option<Vec<u8>>> {
        let session = self.session().await?;
        let path = self.inner.layout.record(name, key);
        match session.client.get_data(&path).await {
            Ok((data, _)) => match decode(&data) {
                Some((_, value)) => Ok(Some(value.to_vec())),
                None => Err(Error::backend(
                    format!("zookeeper: {path} holds no leasehold record"),
                    false,
                )),
            },
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(map(e, &format!("reading {path}"))),
        }
    }

    /// Deletes records past their keep, after the write of `key` beside `name` at `path`.
    /// The write's server time is its stat's mtime; it sweeps `name`'s other records and
    /// those of the next name in turn. Best effort: a failure is logged, and the next write
    /// sweeps again.
    async fn sweep_records(
        &self,
        client: &zk::Client,
        name: &LockName,
        key: &RecordKey,
        path: &str,
        stat: Option<zk::Stat>,
    ) {
        let now = match stat.filter(|s| !s.is_invalid()) {
            Some(stat) => stat.mtime,
            // Some servers answer a create in a multi without its stat (ZOOKEEPER-4026).
            None => match client.check_stat(path).await {
                Ok(Some(stat)) => stat.mtime,
                Ok(None) => return,
                Err(error) => {
                    tracing::debug!(%error, "zookeeper: reading a record's time for a sweep");
                    return;
                }
            },
        };
        let own = self.sweep_name(client, name.as_str(), Some(key.as_str()), now);
        let other = async {
            match self.next_to_sweep(client, name).await? {
                Some(other) => self.sweep_name(client, &other, None, now).await,
                None => Ok(()),
            }
        };
        let (own, other) = tokio::join!(own, other);
        for error in [own.err(), other.err()].into_iter().flatten() {
            tracing::debug!(%error, "zookeeper: sweeping old records");
        }
    }

    /// The name after the one swept last (in name order, round), other than `name`.
    async fn next_to_sweep(&self, client: &zk::Client, name: &LockName) -> Result<Option<String>> {
        let dir = self.inner.layout.records();
        let mut names = or_empty(client.list_children(&dir).await, &dir)?;
        names.retain(|n| n != name.as_str());
        names.sort_unstable();
        let mut last = self.inner.swept.lock().unwrap_or_else(|e| e.into_inner());
        let next = last
            .as_ref()
            .and_then(|last| names.iter().find(|n| *n > last))
            .or(names.first())
            .cloned();
        last.clone_from(&next);
        Ok(next)
    }

    /// Deletes up to [`SWEEP`] of `name`'s records past their keep at the server time `now`.
    /// `skip` (the record just written) aside. Which ones are read turns with `now`, so
    /// that records kept long do not hide the old ones behind them. Nodes that are no
    /// record of ours are left alone. With every record gone, the name's directory goes.
    async fn sweep_name(
        &self,
        client: &zk::Client,
        name: &str,
        skip: Option<&str>,
        now: i64,
    ) -> Result<()> {
        let dir = self.inner.layout.records_dir(name);
        let children = or_empty(client.list_children(&dir).await, &dir)?;
        let others: Vec<&String> = children
            .iter()
            .filter(|c| Some(c.as_str()) != skip)
            .collect();
        let start = i64::try_from(others.len())
            .ok()
            .filter(|len| *len > 0)
            .and_then(|len| usize::try_from(now.rem_euclid(len)).ok())
            .unwrap_or(0);
        let paths: Vec<String> = others
            .iter()
            .cycle()
            .skip(start)
            .take(others.len().min(SWEEP))
            .map(|c| format!("{dir}/{c}"))
            .collect();
        let reads = join_all(paths.iter().map(|p| client.get_data(p))).await;
        let mut deletes = Vec::new();
        let mut gone = 0;
        for (path, read) in paths.iter().zip(reads) {
            match read {
                Ok((data, stat)) => match decode(&data) {
                    Some((keep, _)) if expired(stat.mtime, keep, now) => {
                        deletes.push(client.delete(path, Some(stat.version)));
                    }
                    Some(_) => {}
                    None => {
                        tracing::debug!(node = %path, "zookeeper: a node among records is no leasehold record; left alone");
                    }
                },
                Err(zk::Error::NoNode) => gone += 1,
                Err(e) => return Err(map(e, "reading a record")),
            }
        }
        for deleted in join_all(deletes).await {
            match deleted {
                Ok(()) | Err(zk::Error::NoNode) => gone += 1,
                // Written again since it was read.
                Err(zk::Error::BadVersion) => {}
                Err(e) => return Err(map(e, "deleting an old record")),
            }
        }
        if gone > 0 {
            tracing::debug!(dir, gone, "zookeeper: swept old records");
        }
        if skip.is_none() && gone == children.len() {
            match client.delete(&dir, None).await {
                // Written to since it was listed.
                Ok(()) | Err(zk::Error::NoNode | zk::Error::NotEmpty) => {}
                Err(e) => return Err(map(e, &format!("deleting {dir}"))),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_records_data_is_its_keep_then_its_value() {
        let data = encode(Duration::from_secs(600), b"done\nok");
        assert_eq!(data, b"leasehold-record keep=600000\ndone\nok");
        assert_eq!(decode(&data), Some((600_000, &b"done\nok"[..])));
        // Rounded up to whole milliseconds; an empty value; a keep past i64.
        let data = encode(Duration::from_micros(1_500), b"");
        assert_eq!(decode(&data), Some((2, &b""[..])));
        let data = encode(Duration::MAX, b"x");
        assert_eq!(decode(&data), Some((i64::MAX, &b"x"[..])));
        assert_eq!(decode(&encode(Duration::ZERO, b"x")), Some((0, &b"x"[..])));
        // Not ours.
        for odd in [
            &b""[..],
            b"done",
            b"leasehold-record keep=\nx",
            b"leasehold-record keep=12",
            b"leasehold-record keep=+12\nx",
            b"leasehold-record keep=012\nx",
            b"leasehold-record keep=99999999999999999999\nx",
            b"leasehold-record keep=1s\nx",
        ] {
            assert_eq!(decode(odd), None, "{:?}", String::from_utf8_lossy(odd));
        }
    }

    #[test]
    fn a_record_expires_after_its_keep_by_the_servers_clock() {
        assert!(!expired(1_000, 500, 1_500));
        assert!(expired(1_000, 500, 1_501));
        assert!(!expired(1_000, i64::MAX, i64::MAX));
    }
}
