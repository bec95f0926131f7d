//! `leasehold inspect` and `leasehold locks`.
//! Holders, modes, tokens, time held, remaining TTLs and waiters.

use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::time::Duration;

use leasehold::backend::Holder;
use leasehold::{Client, Eviction, Leader, LockChange, LockState, Mode};
use serde_json::{Value, json};

/// The state of each named lock, as JSON.
pub fn to_json(locks: &[(String, LockState)]) -> Value {
    let locks: Vec<Value> = locks
        .iter()
        .map(|(name, state)| lock_json(name, state))
        .collect();
    json!({ "locks": locks })
}

/// One lock's state, as JSON.
fn lock_json(name: &str, state: &LockState) -> Value {
    json!({
                "name": name,
                "holders": state.holders.iter().map(|h| json!({
                    "owner": h.owner.as_str(),
                    "mode": mode(h.mode),
                    "token": h.token.get(),
                    "remaining_ms": h.remaining.map(|r| r.as_millis() as u64),
                    "held_ms": h.held.map(|r| r.as_millis() as u64),
                    "kept": h.kept,
                    "value": h.value.as_deref().map(value),
                })).collect::<Vec<_>>(),
                "waiters": state.waiters.iter().map(|w| json!({
                    "owner": w.owner.as_str(),
                    "mode": mode(w.mode),
                })).collect::<Vec<_>>(),
                "evictions": evictions_json(&state.evictions),
    })
}

/// The state of each named lock, as a table for people.
/// With `colour`, holders are green and waiters yellow (for a terminal).
pub fn to_table(locks: &[(String, LockState)], colour: bool) -> String {
    const COLUMNS: usize = 8;
    let header = [
        "LOCK", "ROLE", "MODE", "TOKEN", "HELD", "TTL", "OWNER", "VALUE",
    ];
    let mut rows: Vec<[String; COLUMNS]> = vec![header.map(str::to_owned)];
    let seconds = |d: Option<Duration>, none: &str| {
        d.map_or(none.to_owned(), |d| format!("{:.1}s", d.as_secs_f64()))
    };
    for (name, state) in locks {
        if state.holders.is_empty() && state.waiters.is_empty() {
            let mut row = ["-"; COLUMNS].map(str::to_owned);
            row[0].clone_from(name);
            row[1] = "free".into();
            rows.push(row);
        }
        for h in &state.holders {
            rows.push([
                name.clone(),
                // Kept: its holder let go, and it ends when its TTL runs out.
                if h.kept { "kept" } else { "holder" }.into(),
                mode(h.mode),
                h.token.to_string(),
                seconds(h.held, "-"),
                seconds(h.remaining, "none"),
                h.owner.to_string(),
                h.value.as_deref().map_or("-".into(), value),
            ]);
        }
        for w in &state.waiters {
            rows.push([
                name.clone(),
                "waiter".into(),
                mode(w.mode),
                "-".into(),
                "-".into(),
                "-".into(),
                w.owner.to_string(),
                "-".into(),
            ]);
        }
        // The last eviction, as a reminder; --json has them all.
        for e in state.evictions.iter().take(1) {
            rows.push([
                name.clone(),
                "evicted".into(),
                "-".into(),
                e.token.to_string(),
                "-".into(),
                "-".into(),
                e.owner.to_string(),
                format!("by {}: {}", e.by, e.reason),
            ]);
        }
    }
    let widths: Vec<usize> = (0..COLUMNS)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let paint = match row[1].as_str() {
            "holder" | "kept" if colour => Some("32"),
            "waiter" if colour => Some("33"),
            _ => None,
        };
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let line = line.join("  ");
        let line = line.trim_end();
        match paint {
            Some(code) => {
                let _ = writeln!(out, "\x1b[{code}m{line}\x1b[0m");
            }
            None => {
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

/// Eviction records as JSON.
pub fn evictions_json(evictions: &[Eviction]) -> Value {
    evictions
        .iter()
        .map(|e| {
            json!({
                "owner": e.owner.as_str(),
                "token": e.token.get(),
                "by": e.by,
                "reason": e.reason,
                "at_ms": e.at_ms,
            })
        })
        .collect()
}

/// Who is running this command, as `user@host`, for an eviction's record.
pub fn operator() -> String {
    let user = ["USER", "LOGNAME"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| format!("uid{}", rustix::process::getuid().as_raw()));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into());
    format!("{user}@{host}")
}

/// Whether to colour output for people: stdout is a terminal and `NO_COLOR` is not set.
pub fn colour() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Every lock under `prefix` with a holder or a waiter (see [`Client::locks`]).
/// With `older_than`, only locks with a holder that has held at least that long; locks
/// whose grant time the backend does not record are left out then, and counted in the
/// second value.
///
/// # Errors
///
/// A bad prefix, a backend that cannot list, backend errors.
pub async fn list(
    client: &Client,
    prefix: &str,
    older_than: Option<Duration>,
) -> leasehold::Result<(Vec<(String, LockState)>, usize)> {
    let mut unknown = 0;
    let mut locks = Vec::new();
    for (name, state) in client.locks(prefix).await? {
        if let Some(age) = older_than {
            if state.holders.iter().all(|h| h.held.is_none()) {
                unknown += usize::from(!state.holders.is_empty());
                continue;
            }
            if !state
                .holders
                .iter()
                .any(|h| h.held.is_some_and(|h| h >= age))
            {
                continue;
            }
        }
        locks.push((name.to_string(), state));
    }
    Ok((locks, unknown))
}

/// Reads the state of every name.
///
/// # Errors
///
/// The first name that is invalid or cannot be read.
pub async fn collect(
    client: &Client,
    names: &[String],
) -> leasehold::Result<Vec<(String, LockState)>> {
    let mut locks = Vec::with_capacity(names.len());
    for name in names {
        locks.push((name.clone(), client.inspect(name).await?));
    }
    Ok(locks)
}

fn mode(mode: Mode) -> String {
    mode.to_string()
}

/// One line of `leasehold elect --observe`: the leader, or that nobody leads.
/// As text (`leader VALUE term T owner O`, `no leader`) or as a JSON object.
pub fn leader_line(leader: Option<&Leader>, json: bool) -> String {
    match (leader, json) {
        (Some(l), true) => json!({ "leader": {
            "value": value(&l.value),
            "term": l.term.get(),
            "owner": l.owner.as_str(),
            "remaining_ms": l.remaining.map(|r| r.as_millis() as u64),
        }})
        .to_string(),
        (None, true) => json!({ "leader": null }).to_string(),
        (Some(l), false) => format!(
            "leader {} term {} owner {}",
            value(&l.value),
            l.term,
            l.owner
        ),
        (None, false) => "no leader".to_owned(),
    }
}

/// A stored value as text when it is UTF-8, otherwise as hex.
fn value(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => bytes.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

/// What one change of a watched lock was, in words: one line per event.
/// `held`/`waiting` for what a lock had when the watch started; then `granted`, `handoff`
/// (an exclusive holder replaced by another in one read), `freed` (released or expired),
/// `queued`, `left` (a waiter gone without a grant) and `evicted`.
pub fn events(change: &LockChange) -> Vec<String> {
    let (before, after) = (&change.before, &change.after);
    let grant = |h: &Holder| format!("{} token {} ({})", h.owner, h.token, h.mode);
    let is_in = |h: &Holder, state: &LockState| {
        (state.holders.iter()).any(|o| o.owner == h.owner && o.token == h.token)
    };
    let name = &change.name;
    let mut lines = Vec::new();
    if change.first {
        lines.extend(
            after
                .holders
                .iter()
                .map(|h| format!("{name} held by {}", grant(h))),
        );
        lines.extend(
            (after.waiters.iter()).map(|w| format!("{name} waiting {} ({})", w.owner, w.mode)),
        );
        return lines;
    }
    let handoff = change
        .hand_off()
        .filter(|(from, to)| !is_in(from, after) && !is_in(to, before));
    if let Some((from, to)) = handoff {
        lines.push(format!("{name} handoff {} -> {}", grant(from), grant(to)));
    }
    let handed = |h: &Holder| handoff.is_some_and(|(from, to)| from == h || to == h);
    for e in after
        .evictions
        .iter()
        .filter(|e| !before.evictions.contains(e))
    {
        lines.push(format!(
            "{name} evicted {} token {} by {}: {}",
            e.owner, e.token, e.by, e.reason
        ));
    }
    for h in before
        .holders
        .iter()
        .filter(|h| !is_in(h, after) && !handed(h))
    {
        lines.push(format!("{name} freed {}", grant(h)));
    }
    for h in after
        .holders
        .iter()
        .filter(|h| !is_in(h, before) && !handed(h))
    {
        lines.push(format!("{name} granted {}", grant(h)));
    }
    let granted = |owner: &leasehold::OwnerId| after.holders.iter().any(|h| h.owner == *owner);
    for w in after.waiters.iter().filter(|w| !before.waiters.contains(w)) {
        lines.push(format!("{name} queued {} ({})", w.owner, w.mode));
    }
    for w in before
        .waiters
        .iter()
        .filter(|w| !after.waiters.contains(w) && !granted(&w.owner))
    {
        lines.push(format!("{name} left {} ({})", w.owner, w.mode));
    }
    lines
}

/// One change of a watched lock, as a JSON object.
/// When it was seen, its events (as [`events`] words them) and the lock's state now.
pub fn change_json(change: &LockChange, at_ms: u128) -> Value {
    let mut object = lock_json(change.name.as_str(), &change.after);
    object["at_ms"] = json!(at_ms);
    object["first"] = json!(change.first);
    object["events"] = json!(events(change));
    object
}

/// Now as `HH:MM:SS.mmm` (UTC), for a watch's lines.
pub fn clock_time(at_ms: u128) -> String {
    let ms = at_ms % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}
