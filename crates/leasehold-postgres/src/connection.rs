//! Connections: how one is opened, its prepared statements, the pool lease mode shares.
//! The pool is small; every lease-mode request takes one of its connections.
//!
//! tokio-postgres pipelines the requests of many tasks on one connection, so the pool is a
//! fixed handful of connections: a lock request takes the one of its lane (see
//! `Request::lane`), anything else the next in turn; a connection found closed is replaced
//! on the next use of its place.
//!
//! A connection can also go silent without closing (a blackholed link, a peer host that
//! vanished): everything sent on it then waits forever. After a few requests in a row were
//! given up by their callers (a request timeout, a cancel) with nothing answered since
//! they were sent (`support::health`), the connection counts as closed, and its place
//! connects anew.
//!
//! What was sent on a silent connection may still reach its server session later (a link
//! that heals delivers what it held), and run there after the requests sent on the new
//! connection meanwhile: an acquire after its own release, a grant nobody will release.
//! So before a new connection takes the place of one that went silent with its socket
//! still open, it ends the old one's server session (`pg_terminate_backend`, waiting
//! until the process is gone): whatever the old session ran, it ran before anything the
//! new one runs, and what it had not read yet it never runs. A connection whose socket
//! closed is not ended that way: through a session-pooling proxy its server session may
//! already serve another client. Through a transaction-pooling proxy, which shares server
//! sessions between clients, no session is ended.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use leasehold_core::backend::Request;
use leasehold_core::support::health::Health;
use leasehold_core::{Error, Result};
use tokio::sync::watch;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, SimpleQueryMessage, Socket, Statement};

use crate::error::{map, undecodable};
use crate::options::{PostgresOptions, SslMode};
use crate::statements::Stmt;
use crate::tls::{Tls, TlsStream};

/// The connection half tokio-postgres hands back: it must be driven for the client to work.
pub(crate) type Driver = tokio_postgres::Connection<Socket, TlsStream>;

/// Opens connections to the server of the options.
#[derive(Debug)]
pub(crate) struct Connector {
    config: tokio_postgres::Config,
    tls: Tls,
    timeout: Duration,
    /// Each statement's SQL, by [`Stmt::index`].
    sql: Arc<[String]>,
    /// Prepare statements once per connection (not through a transaction pool).
    prepare: bool,
    shown: String,
}

impl Connector {
    pub(crate) fn new(options: &PostgresOptions) -> Result<Self> {
        let mut config = tokio_postgres::Config::new();
        for (host, port) in &options.hosts {
            config.host(host).port(*port);
        }
        config
            .user(&options.user)
            .dbname(&options.dbname)
            .application_name(&options.application_name)
            .connect_timeout(options.connect_timeout)
            .ssl_mode(match options.sslmode {
                SslMode::Disable => tokio_postgres::config::SslMode::Disable,
                SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
                SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                    tokio_postgres::config::SslMode::Require
                }
            })
            .target_session_attrs(if options.read_write {
                tokio_postgres::config::TargetSessionAttrs::ReadWrite
            } else {
                tokio_postgres::config::TargetSessionAttrs::Any
            });
        if let Some(password) = &options.password {
            config.password(password.expose());
        }
        let shown = options
            .hosts
            .iter()
            .map(|(host, port)| format!("{host}:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        Ok(Self {
            config,
            tls: Tls::new(options.sslmode, &options.tls)?,
            timeout: options.connect_timeout,
            sql: Stmt::ALL.iter().map(|s| s.sql(&options.schema)).collect(),
            prepare: true,
            shown: format!("{shown}/{}", options.dbname),
        })
    }

    /// From now on, statements are not prepared (a transaction pool is in between).
    pub(crate) fn without_prepared_statements(&mut self) {
        self.prepare = false;
    }

    /// The TLS set-up (for cancel requests).
    pub(crate) fn tls(&self) -> Tls {
        self.tls.clone()
    }

    /// How long connecting may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Where it connects, for messages (no credentials).
    pub(crate) fn shown(&self) -> &str {
        &self.shown
    }

    /// A new connection whose driver the caller runs.
    pub(crate) async fn open(&self) -> Result<(Client, Driver)> {
        let opened = tokio::time::timeout(
            self.timeout + Duration::from_millis(100),
            self.config.connect(self.tls.clone()),
        )
        .await
        .map_err(|_| {
            Error::unavailable(format!(
                "postgres: connecting to {} timed out after {:?}",
                self.shown, self.timeout
            ))
        })?;
        opened.map_err(|e| map(e, &format!("connecting to {}", self.shown)))
    }

    /// A new connection, driven by a task of its own, with its statements ready.
    pub(crate) async fn connect(&self) -> Result<Conn> {
        let (client, driver) = self.open().await?;
        let mut conn = Conn::start(client, driver, self);
        conn.prepare(self).await?;
        Ok(conn)
    }
}

/// A server session: its process and when it started.
/// The two name one session; a process id is used again once its process is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Session {
    pid: i32,
    started: SystemTime,
}

/// One connection with its statements.
#[derive(Debug)]
pub(crate) struct Conn {
    client: Client,
    prepared: Option<Vec<Statement>>,
    /// Its server session, known once prepared (never through a transaction pool).
    session: Option<Session>,
    sql: Arc<[String]>,
    closed: watch::Receiver<bool>,
    /// Ends the driver (see [`close`](Conn::close)).
    close: Arc<tokio::sync::Notify>,
    /// Whether it still answers.
    health: Health,
    /// The task driving the connection, aborted on drop.
    /// That closes the socket even while a statement is still running (tokio-postgres would
    /// otherwise wait for its answer).
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Conn {
    /// A connection whose driver now runs in a task of its own.
    /// It has no statement prepared (each is then sent with its text).
    pub(crate) fn start(client: Client, driver: Driver, connector: &Connector) -> Self {
        let (closed_tx, closed) = watch::channel(false);
        let close = Arc::new(tokio::sync::Notify::new());
        let closing = close.clone();
        let driver = tokio::spawn(async move {
            tokio::select! {
                ended = driver => if let Err(error) = ended {
                    tracing::debug!(%error, "postgres connection ended");
                },
                // Dropping the driver closes the socket.
                () = closing.notified() => {}
            }
            closed_tx.send_replace(true);
        });
        Self {
            client,
            prepared: None,
            session: None,
            sql: connector.sql.clone(),
            closed,
            close,
            health: Health::new(),
            driver,
        }
    }

    /// Closes the connection, even while a statement runs on it.
    /// The server ends its session, and frees whatever the session held.
    pub(crate) fn close(&self) {
        self.close.notify_one();
    }

    /// Prepares its statements ([`Stmt::prepared`]) and learns its session.
    /// Both are sent at once (one round trip), unless `connector` says not to prepare. The
    /// session is learnt so that a connection replacing this one can end it (see the module
    /// docs).
    pub(crate) async fn prepare(&mut self, connector: &Connector) -> Result<()> {
        if !connector.prepare {
            return Ok(());
        }
        let prepares = Stmt::ALL.iter().filter(|s| s.prepared()).map(|s| {
            self.client
                .prepare_typed(&connector.sql[s.index()], s.types())
        });
        let session = self
            .client
            .query_typed(&connector.sql[Stmt::Session.index()], &[]);
        let (prepared, session) =
            futures_util::future::try_join(futures_util::future::try_join_all(prepares), session)
                .await
                .map_err(|e| map(e, "preparing statements"))?;
        self.prepared = Some(prepared);
        let doing = "finding the connection's session";
        self.session = match session.first() {
            Some(row) => Some(Session {
                pid: row.try_get(0).map_err(|e| undecodable(doing, e))?,
                started: row.try_get(1).map_err(|e| undecodable(doing, e))?,
            }),
            None => None,
        };
        Ok(())
    }

    /// Ends the server session of `old`, which this connection replaces, if it may still run.
    /// It may when its socket is still open (it went silent); the server is given up to
    /// `wait` for the session's process to be gone. Then nothing sent on `old` can run
    /// after what is sent on this one.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the session did not end in time; errors of the statement.
    pub(crate) async fn end_session_of(&self, old: &Conn, wait: Duration) -> Result<()> {
        let Some(session) = old.session else {
            return Ok(());
        };
        if old.has_ended() {
            return Ok(());
        }
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX).max(1);
        let row = self
            .query_one(
                Stmt::EndSession,
                &[&session.pid, &session.started, &wait_ms],
                "ending the session of a replaced connection",
            )
            .await?;
        let ended: bool = row
            .try_get(0)
            .map_err(|e| undecodable("ending the session of a replaced connection", e))?;
        if ended {
            tracing::debug!(
                pid = session.pid,
                "ended the session of a silent connection"
            );
            Ok(())
        } else {
            Err(Error::unavailable(format!(
                "postgres: the session of a silent connection (process {}) did not end within {wait:?}",
                session.pid
            )))
        }
    }

    /// The client, for statements of the caller's own.
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// Whether the connection has ended, or went silent (see the module docs).
    pub(crate) fn is_closed(&self) -> bool {
        self.has_ended() || self.health.is_stalled()
    }

    /// Whether its socket has closed.
    fn has_ended(&self) -> bool {
        self.client.is_closed() || *self.closed.borrow()
    }

    /// Completes when the connection has ended.
    pub(crate) async fn closed(&self) {
        let mut closed = self.closed.clone();
        let _ = closed.wait_for(|c| *c).await;
    }

    /// Runs `stmt` with `params`; its rows.
    pub(crate) async fn query(
        &self,
        stmt: Stmt,
        params: &[&(dyn ToSql + Sync)],
        doing: &str,
    ) -> Result<Vec<Row>> {
        let in_flight = self.health.request();
        // The prepared statements come first in `Stmt::ALL`: the others are not among them.
        let rows = match self.prepared.as_ref().and_then(|p| p.get(stmt.index())) {
            Some(prepared) => self.client.query(prepared, params).await,
            None => {
                let typed: Vec<_> = params
                    .iter()
                    .zip(stmt.types())
                    .map(|(p, t)| (*p, t.clone()))
                    .collect();
                self.client
                    .query_typed(&self.sql[stmt.index()], &typed)
                    .await
            }
        };
        in_flight.answered();
        rows.map_err(|e| map(e, doing))
    }

    /// Runs `stmt`, which answers one row.
    pub(crate) async fn query_one(
        &self,
        stmt: Stmt,
        params: &[&(dyn ToSql + Sync)],
        doing: &str,
    ) -> Result<Row> {
        let mut rows = self.query(stmt, params, doing).await?;
        match rows.len() {
            1 => Ok(rows.swap_remove(0)),
            n => Err(undecodable(doing, format!("{n} rows instead of one"))),
        }
    }
}

/// A fixed number of connections, chosen by lane or in turn.
#[derive(Debug)]
pub(crate) struct Pool {
    connector: Arc<Connector>,
    slots: Box<[Slot]>,
    next: AtomicUsize,
}

#[derive(Debug, Default)]
struct Slot {
    conn: std::sync::Mutex<Option<Arc<Conn>>>,
    /// Held while (re)connecting, so that one connection is made at a time per place.
    connecting: tokio::sync::Mutex<()>,
}

impl Slot {
    fn current(&self) -> Option<Arc<Conn>> {
        self.conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .filter(|c| !c.is_closed())
    }
}

impl Pool {
    /// A pool of `size` connections, the first of them `initial`.
    pub(crate) fn new(connector: Arc<Connector>, size: usize, initial: Vec<Conn>) -> Self {
        let slots: Box<[Slot]> = (0..size.max(1)).map(|_| Slot::default()).collect();
        for (slot, conn) in slots.iter().zip(initial) {
            *slot.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(conn));
        }
        Self {
            connector,
            slots,
            next: AtomicUsize::new(0),
        }
    }

    /// What opens its connections (and those of change feeds).
    pub(crate) fn connector(&self) -> &Arc<Connector> {
        &self.connector
    }

    /// The next connection in turn, (re)connected if needed.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the server cannot be reached.
    pub(crate) async fn get(&self) -> Result<Arc<Conn>> {
        let place = self.next.fetch_add(1, Ordering::Relaxed);
        self.at(place).await
    }

    /// The connection of `req`'s lane.
    /// Every request of one acquisition goes on the same connection, where the server runs
    /// them in the order they were sent, so that a late acquire (sent before a release
    /// whose answer came first on another connection) cannot be run after the release and
    /// leave a grant nobody owns. A client that holds one lock at a time uses one
    /// connection; concurrent acquisitions spread over all.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] if the server cannot be reached.
    pub(crate) async fn get_for(&self, req: &Request) -> Result<Arc<Conn>> {
        self.at(self.place_for(req)).await
    }

    /// The place of the connection [`get_for`](Pool::get_for) takes for `req`.
    /// Requests with the same place go on the same connection.
    pub(crate) fn place_for(&self, req: &Request) -> usize {
        req.lane as usize % self.slots.len()
    }

    /// How many connections it has (places, from 0).
    pub(crate) fn size(&self) -> usize {
        self.slots.len()
    }

    async fn at(&self, place: usize) -> Result<Arc<Conn>> {
        let slot = &self.slots[place % self.slots.len()];
        if let Some(conn) = slot.current() {
            return Ok(conn);
        }
        let _connecting = slot.connecting.lock().await;
        if let Some(conn) = slot.current() {
            return Ok(conn);
        }
        let conn = Arc::new(self.connector.connect().await?);
        let replaced = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(old) = replaced {
            // Before anything is sent on the new connection (see the module docs).
            conn.end_session_of(&old, self.connector.timeout()).await?;
            old.close();
        }
        *slot.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
        Ok(conn)
    }
}

/// The first column of the first row of a simple query's answer.
fn first_value(messages: &[SimpleQueryMessage]) -> Option<&str> {
    messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(row) => row.get(0),
        _ => None,
    })
}

/// Whether `a` and `b` go through a pool that hands sessions on between transactions.
/// They are two connections to the same URL; such a pool (PgBouncer's `pool_mode =
/// transaction`) hands a server session to another client between transactions.
///
/// `a` asks for its server process; `b` opens a transaction and asks for its own; `a` asks
/// again while `b`'s transaction is open. Straight to the server (or through a TCP proxy or a
/// session pool) the two are different processes and `a` keeps its own. A transaction pool
/// gives `b` the process `a` just released (PgBouncer reuses the last released first), or
/// hands `a` another one the second time. Found out on connect; a URL can say so instead
/// (`pooling=transaction` or `pooling=session`).
pub(crate) async fn transaction_pooled(a: &Client, b: &Client) -> Result<bool> {
    let doing = "finding out whether a connection pool is in between";
    let pid = async |client: &Client, sql: &str| -> Result<String> {
        let answer = client.simple_query(sql).await.map_err(|e| map(e, doing))?;
        first_value(&answer)
            .map(str::to_owned)
            .ok_or_else(|| undecodable(doing, "no row"))
    };
    let first = pid(a, "SELECT pg_backend_pid()").await?;
    let other = pid(b, "BEGIN; SELECT pg_backend_pid()").await;
    let again = match &other {
        Ok(_) => pid(a, "SELECT pg_backend_pid()").await,
        Err(_) => Ok(String::new()),
    };
    let ended = b.batch_execute("COMMIT").await.map_err(|e| map(e, doing));
    let (other, again) = (other?, again?);
    ended?;
    Ok(first == other || first != again)
}

/// Whether a session keeps its state between its transactions and is told of notifications.
/// A connection of its own listens on a channel made for this test, and `notifier` notifies
/// it. A transaction pool (PgBouncer's `pool_mode = transaction`) has given the listening
/// session back to the pool by then, and the message never reaches the listening client;
/// directly, or through a session pool, it arrives within milliseconds. `false` after
/// `limit` without it.
pub(crate) async fn notifications_arrive(
    connector: &Connector,
    notifier: &Client,
    limit: Duration,
) -> Result<bool> {
    use futures_util::StreamExt;
    let doing = "finding out whether notifications arrive";
    let channel = format!("leasehold.probe.{}", leasehold_core::OwnerId::generate());
    let (listener, mut driver) = connector.open().await?;
    let mut messages = futures_util::stream::poll_fn(move |cx| driver.poll_message(cx)).boxed();
    let statement = format!("LISTEN \"{channel}\"");
    let listen = listener.batch_execute(&statement);
    tokio::pin!(listen);
    // The channel's name is hex digits, dashes and dots: safe to write into the statement
    // (sent as a simple query, which a transaction pool serves like any other).
    let notify = format!("SELECT pg_notify('{channel}', '')");
    let arrived = async {
        let mut listened = false;
        loop {
            tokio::select! {
                done = &mut listen, if !listened => {
                    done.map_err(|e| map(e, doing))?;
                    listened = true;
                    notifier
                        .simple_query(&notify)
                        .await
                        .map_err(|e| map(e, doing))?;
                }
                message = messages.next() => match message {
                    Some(Ok(tokio_postgres::AsyncMessage::Notification(note)))
                        if note.channel() == channel => return Ok(true),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(map(e, doing)),
                    None => return Ok(false),
                },
            }
        }
    };
    match tokio::time::timeout(limit, arrived).await {
        Ok(answer) => answer,
        Err(_) => Ok(false),
    }
}
