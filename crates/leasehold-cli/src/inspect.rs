//! `leasehold inspect`: holders, modes, tokens, remaining TTLs and waiters.

use std::fmt::Write as _;

use leasehold::{Client, LockState, Mode};
use serde_json::{Value, json};

/// The state of each named lock, as JSON.
pub fn to_json(locks: &[(String, LockState)]) -> Value {
    let locks: Vec<Value> = locks
        .iter()
        .map(|(name, state)| {
            json!({
                "name": name,
                "holders": state.holders.iter().map(|h| json!({
                    "owner": h.owner.as_str(),
                    "mode": mode(h.mode),
                    "token": h.token.get(),
                    "remaining_ms": h.remaining.map(|r| r.as_millis() as u64),
                    "value": h.value.as_deref().map(value),
                })).collect::<Vec<_>>(),
                "waiters": state.waiters.iter().map(|w| json!({
                    "owner": w.owner.as_str(),
                    "mode": mode(w.mode),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "locks": locks })
}

/// The state of each named lock, as a table for people.
pub fn to_table(locks: &[(String, LockState)]) -> String {
    let mut rows = vec![[
        "LOCK".to_owned(),
        "ROLE".to_owned(),
        "MODE".to_owned(),
        "TOKEN".to_owned(),
        "TTL".to_owned(),
        "OWNER".to_owned(),
        "VALUE".to_owned(),
    ]];
    for (name, state) in locks {
        if state.holders.is_empty() && state.waiters.is_empty() {
            rows.push([
                name.clone(),
                "free".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
        for h in &state.holders {
            rows.push([
                name.clone(),
                "holder".into(),
                mode(h.mode),
                h.token.to_string(),
                h.remaining
                    .map_or("none".into(), |r| format!("{:.1}s", r.as_secs_f64())),
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
                w.owner.to_string(),
                "-".into(),
            ]);
        }
    }
    let widths: Vec<usize> = (0..7)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
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

/// A stored value as text when it is UTF-8, otherwise as hex.
fn value(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => bytes.iter().map(|b| format!("{b:02x}")).collect(),
    }
}
