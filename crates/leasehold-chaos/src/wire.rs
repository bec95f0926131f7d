//! What travels between the processes of a run: JSON lines over loopback TCP.
//!
//! Every process opens one connection to the collector and says who it is; it sends
//! events (asking for an acknowledgement for invokes) and receives acknowledgements and
//! commands. Workers talk to the fenced resource over connections of their own.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::history::{Event, Kind, Phase};

/// From a process to the collector.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Up {
    /// The first message: who is speaking.
    Hello {
        /// The process's name, such as `w1` or `resource`.
        process: String,
        /// Its pid.
        pid: u32,
    },
    /// An event to stamp; `ack`: answer with its stamp.
    Event {
        /// The event (its stamp fields are ignored).
        event: Box<Event>,
        /// Whether to acknowledge.
        ack: bool,
    },
}

/// From the collector to a process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Down {
    /// The answer to hello: the collector's clock origin (`CLOCK_BOOTTIME`, ns).
    /// With it a process can put instants of its own on the collector's timeline.
    Welcome {
        /// The run's origin.
        origin_ns: u64,
    },
    /// An event was stamped.
    Ack {
        /// Its stamp.
        t: u64,
    },
    /// Do something.
    Command(Command),
}

/// A command from the runner to a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Command {
    /// Finish the current hold (release), stop working and exit.
    Stop,
    /// For workers sharing an in-process backend: a link fault between this worker and it.
    /// One of `cut_to_server`, `cut_to_client`, `cut_both`, `heal`, `reset`, or a delay of
    /// its replies.
    Link {
        /// What to do.
        action: String,
        /// For delays: how long, ms.
        #[serde(default)]
        delay_ms: u64,
    },
}

/// A request to the fenced resource.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResourceRequest {
    /// `read`, `write` or `final`.
    pub op: String,
    /// The worker's operation id.
    #[serde(default)]
    pub id: u64,
    /// Who.
    #[serde(default)]
    pub worker: String,
    /// The guard's owner id.
    #[serde(default)]
    pub owner: String,
    /// The fencing token.
    #[serde(default)]
    pub token: u64,
    /// The value to write.
    #[serde(default)]
    pub value: serde_json::Value,
}

/// The resource's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResourceReply {
    /// The request's id.
    pub id: u64,
    /// Accepted (or, for `final`, answered).
    pub ok: bool,
    /// The value read, or the final state.
    #[serde(default)]
    pub value: serde_json::Value,
    /// The highest token accepted so far.
    #[serde(default)]
    pub highest: Option<u64>,
}

/// Reads the collector's clock: `CLOCK_BOOTTIME` in nanoseconds.
/// It is the clock leasehold's deadlines use, shared by every process of the machine.
pub fn boottime_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Writes one JSON line.
pub(crate) async fn send_line<W: AsyncWriteExt + Unpin, T: Serialize>(
    out: &mut W,
    message: &T,
) -> io::Result<()> {
    let mut line = serde_json::to_vec(message)?;
    line.push(b'\n');
    out.write_all(&line).await
}

/// A process's connection to the collector.
/// It stamps invokes synchronously, completions in the background, and passes commands on.
/// Clones share the connection.
#[derive(Debug, Clone)]
pub struct Sink {
    process: String,
    out: mpsc::UnboundedSender<(Vec<u8>, Option<oneshot::Sender<u64>>)>,
    next_op: Arc<AtomicU64>,
    origin_ns: u64,
}

impl Sink {
    /// Connects to the collector at `addr` as `process`.
    /// Returns the sink and the commands that will arrive. Operation ids start at
    /// `first_op`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the connection; the collector forgets the process.
    ///
    /// # Errors
    ///
    /// If the collector cannot be reached or does not welcome the process.
    pub async fn connect(
        addr: std::net::SocketAddr,
        process: &str,
        first_op: u64,
    ) -> io::Result<(Sink, mpsc::UnboundedReceiver<Command>)> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (read, mut write) = stream.into_split();
        send_line(
            &mut write,
            &Up::Hello {
                process: process.to_owned(),
                pid: std::process::id(),
            },
        )
        .await?;
        let mut lines = BufReader::new(read).lines();
        let origin_ns = match lines.next_line().await? {
            Some(line) => match serde_json::from_str(&line)? {
                Down::Welcome { origin_ns } => origin_ns,
                other => {
                    return Err(io::Error::other(format!(
                        "the collector answered hello with {other:?}"
                    )));
                }
            },
            None => return Err(io::Error::other("the collector closed the connection")),
        };
        let (out, mut queue) = mpsc::unbounded_channel::<(Vec<u8>, Option<oneshot::Sender<u64>>)>();
        let (acks_tx, mut acks_rx) = mpsc::unbounded_channel::<oneshot::Sender<u64>>();
        let (commands_tx, commands) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some((line, ack)) = queue.recv().await {
                if let Some(ack) = ack {
                    let _ = acks_tx.send(ack);
                }
                if write.write_all(&line).await.is_err() {
                    return;
                }
            }
        });
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<Down>(&line) {
                    Ok(Down::Ack { t }) => {
                        if let Some(waiter) = acks_rx.recv().await {
                            let _ = waiter.send(t);
                        }
                    }
                    Ok(Down::Command(command)) => {
                        let _ = commands_tx.send(command);
                    }
                    _ => {}
                }
            }
            // The collector is gone: the run is over.
            let _ = commands_tx.send(Command::Stop);
        });
        Ok((
            Sink {
                process: process.to_owned(),
                out,
                next_op: Arc::new(AtomicU64::new(first_op)),
                origin_ns,
            },
            commands,
        ))
    }

    /// This process's name.
    pub fn process(&self) -> &str {
        &self.process
    }

    /// A new operation id.
    pub fn next_op(&self) -> u64 {
        self.next_op.fetch_add(1, Ordering::Relaxed)
    }

    /// An event of this process.
    pub fn event(&self, kind: Kind, phase: Phase) -> Event {
        Event::new(self.process.clone(), kind, phase)
    }

    /// `CLOCK_BOOTTIME` (ns) as collector time (µs).
    pub fn collector_time(&self, boottime_ns: u64) -> u64 {
        boottime_ns.saturating_sub(self.origin_ns) / 1000
    }

    fn line(event: Event, ack: bool) -> Vec<u8> {
        let mut line = serde_json::to_vec(&Up::Event {
            event: Box::new(event),
            ack,
        })
        .unwrap_or_default();
        line.push(b'\n');
        line
    }

    /// Sends an invoke and waits until the collector stamped it.
    /// What follows happens after the stamp. Returns the stamp (0 if the collector is
    /// gone).
    ///
    /// # Cancel safety
    ///
    /// The event is recorded whether or not the future is dropped.
    pub async fn invoke(&self, event: Event) -> u64 {
        let (tx, rx) = oneshot::channel();
        if self.out.send((Self::line(event, true), Some(tx))).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    /// Sends an event without waiting (completions: stamped no earlier than they happened).
    pub fn send(&self, event: Event) {
        let _ = self.out.send((Self::line(event, false), None));
    }
}
