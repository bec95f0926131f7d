//! `leasehold audit --follow --listen ADDR`: events streamed to the auditor over TCP.
//!
//! Each connection is a host sending JSON lines, as a file would hold them. Its first line
//! may name it (`{"host":"web-1"}`); otherwise it is named by its peer's IP address. A host
//! that connects again under the same name goes on as the same host, its holds still open
//! ended at its last event (what it sent in the break may be lost). Nothing is
//! authenticated: listen on a private address. Lines longer than
//! [`MAX_LINE`] are skipped and counted as unreadable. What was received after the last save
//! of the state is not received again after a restart (the sender does not resend): a
//! sender that must not lose a line writes a file the auditor follows instead.

use std::collections::HashMap;
use std::net::SocketAddr;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, BufReader};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use super::Auditor;

/// The most connections open at once; more are closed as they come.
pub const MAX_CONNECTIONS: usize = 1_024;

/// The longest line taken, in bytes.
pub const MAX_LINE: usize = 64 * 1024;

/// What a connection sent.
#[derive(Debug)]
pub(super) enum Incoming {
    /// A line (without its end) from connection `conn`, whose peer is `peer`.
    Line {
        conn: u64,
        peer: SocketAddr,
        text: String,
    },
    /// A line over [`MAX_LINE`] from `conn`.
    TooLong,
}

/// The listening socket and the lines its connections send.
#[derive(Debug)]
pub(super) struct Streams {
    lines: mpsc::Receiver<Incoming>,
    /// The host each connection is, once its first line came.
    hosts: HashMap<u64, usize>,
    accepting: JoinHandle<()>,
}

impl Drop for Streams {
    fn drop(&mut self) {
        // The connections' readers belong to the accepting task: they end with it.
        self.accepting.abort();
    }
}

impl Streams {
    /// Listens on `address`.
    pub(super) async fn bind(address: SocketAddr) -> Result<Self, String> {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|e| format!("cannot listen on {address}: {e}"))?;
        // Bounded: a sender faster than the auditor is slowed by TCP, not buffered here.
        let (send, lines) = mpsc::channel(4_096);
        let accepting = tokio::spawn(accept(listener, send));
        Ok(Self {
            lines,
            hosts: HashMap::new(),
            accepting,
        })
    }

    /// The next thing a connection sent.
    pub(super) async fn next(&mut self) -> Option<Incoming> {
        self.lines.recv().await
    }

    /// Feeds `incoming`, and everything already received after it, to `auditor`.
    pub(super) fn feed(&mut self, incoming: Incoming, auditor: &mut Auditor) {
        self.one(incoming, auditor);
        self.drain(auditor);
    }

    /// Feeds everything already received to `auditor`.
    pub(super) fn drain(&mut self, auditor: &mut Auditor) {
        while let Ok(incoming) = self.lines.try_recv() {
            self.one(incoming, auditor);
        }
    }

    fn one(&mut self, incoming: Incoming, auditor: &mut Auditor) {
        let (conn, peer, text) = match incoming {
            Incoming::Line { conn, peer, text } => (conn, peer, text),
            Incoming::TooLong => {
                auditor.unreadable();
                return;
            }
        };
        if let Some(&host) = self.hosts.get(&conn) {
            auditor.line(host, &text);
            return;
        }
        // The first line: a name, or the first event of a host named by its address.
        let hello = serde_json::from_str::<Value>(&text)
            .ok()
            .filter(|v| v.get("kind").is_none())
            .and_then(|v| v.get("host").and_then(Value::as_str).map(str::to_owned));
        // Unnamed, a host is its address (not its port: that changes with every connection).
        let name = hello.clone().unwrap_or_else(|| peer.ip().to_string());
        let known = auditor.hosts().contains(&name);
        let host = auditor.host_named(name);
        if known {
            auditor.reconnected(host);
        }
        self.hosts.insert(conn, host);
        if hello.is_none() {
            auditor.line(host, &text);
        }
    }
}

/// Accepts connections and reads each in a task of its own, until aborted.
async fn accept(listener: TcpListener, send: mpsc::Sender<Incoming>) {
    let mut readers = JoinSet::new();
    let mut next = 0_u64;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    // Out of descriptors, most likely: give the readers a moment to end.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                };
                if readers.len() >= MAX_CONNECTIONS {
                    continue;
                }
                next += 1;
                readers.spawn(read(BufReader::new(stream), next, peer, send.clone()));
            }
            // Reap the readers that ended, so that their number stays that of open connections.
            Some(_) = readers.join_next(), if !readers.is_empty() => {}
        }
    }
}

/// Sends each line `conn` sends, until it closes or the auditor is gone.
async fn read(
    mut stream: BufReader<tokio::net::TcpStream>,
    conn: u64,
    peer: SocketAddr,
    send: mpsc::Sender<Incoming>,
) {
    let mut line = Vec::new();
    loop {
        line.clear();
        let limit = u64::try_from(MAX_LINE).unwrap_or(u64::MAX) + 1;
        match (&mut stream).take(limit).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let incoming = if line.last() == Some(&b'\n') {
            line.pop();
            Incoming::Line {
                conn,
                peer,
                text: String::from_utf8_lossy(&line).into_owned(),
            }
        } else if line.len() > MAX_LINE {
            // Skip the rest of the line.
            let mut rest = Vec::new();
            loop {
                rest.clear();
                match (&mut stream).take(limit).read_until(b'\n', &mut rest).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) if rest.last() == Some(&b'\n') => break,
                    Ok(_) => {}
                }
            }
            Incoming::TooLong
        } else {
            // The connection closed in the middle of a line: it was never whole.
            return;
        };
        if send.send(incoming).await.is_err() {
            return;
        }
    }
}
