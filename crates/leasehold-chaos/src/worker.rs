//! A worker process: locks and, under each guard, reads and writes the fenced resource.
//! It locks through the real toolkit (`leasehold::connect_backend`, `Client`, `Mutex`),
//! uses the guard's token, and reports every step to the collector.
//!
//! Every backend call is recorded below the engine by a [`Recorder`]; the worker's own
//! steps (lock, reads and writes with the result of `Guard::is_held`, unlock, the loss
//! signal) are recorded around them. A process normally hosts one worker; the in-memory
//! backend's workers share one process (they share its server), with a link of the
//! harness's per worker standing in for the network.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use leasehold::backend::{Backend, Mode, Request};
use leasehold::events::JsonLines;
use leasehold::{Client, LockName, LockOptions, OwnerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use crate::harness::{Link, LinkWorker};
use crate::history::{Kind, Phase};
use crate::recorder::Recorder;
use crate::resource::{Access, ResourceClient, Workload};
use crate::wire::{Command, ResourceRequest, Sink};

/// How a worker process is started (passed as JSON on its command line).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerConfig {
    /// The workers this process hosts (`w1`, …; several only for the in-memory backend).
    pub processes: Vec<String>,
    /// How many times this worker was started before (operation ids differ per start).
    pub incarnation: u32,
    /// The backend.
    pub url: String,
    /// The lock's name.
    pub lock: String,
    /// The collector.
    pub collector: SocketAddr,
    /// The fenced resource.
    pub resource: SocketAddr,
    /// The lease asked for.
    pub ttl_ms: u64,
    /// The engine's request timeout.
    pub request_timeout_ms: u64,
    /// Lock-delay, if any.
    #[serde(default)]
    pub lock_delay_ms: Option<u64>,
    /// Where each worker writes its lock events (`<worker>.<incarnation>.jsonl`), if anywhere.
    /// They are what `leasehold audit` reads.
    #[serde(default)]
    pub events_dir: Option<PathBuf>,
    /// How long one lock call waits.
    pub wait_ms: u64,
    /// Read-modify-write rounds per hold: at least, at most.
    pub rounds: (u32, u32),
    /// Pause between rounds.
    pub pause_ms: u64,
    /// Longest pause between holds.
    pub think_ms: u64,
    /// What the rounds do.
    pub workload: Workload,
    /// Workers that spin on `try_lock` instead of waiting in `lock_timeout`.
    #[serde(default)]
    pub spin: Vec<String>,
    /// Workers that also send releases the server must refuse.
    /// They send them under a random owner id, and under their own previous (superseded)
    /// owner id.
    #[serde(default)]
    pub rogue: Vec<String>,
    /// A planted bug (checker tests only).
    #[serde(default)]
    pub bug: Option<String>,
    /// Names this worker holds besides the lock, from its start to its end.
    /// A loss of one is reported as a `lost` event of that name.
    #[serde(default)]
    pub side_locks: u32,
    /// The resource checks accesses with `still_owner` in a transaction per hold.
    /// The worker tells it the hold is over (`end`) before releasing.
    #[serde(default)]
    pub still_owner: bool,
    /// Seeds the worker's own choices (hold lengths, think times).
    pub seed: u64,
}

/// Runs the worker(s) of `config` until told to stop.
///
/// In-process workers (the in-memory backend's) reach their server through a `link` of
/// the harness's.
///
/// # Cancel safety
///
/// Dropping the future drops the guards: their locks are released in the background, or
/// expire.
///
/// # Errors
///
/// If the collector cannot be reached, the configuration is invalid, or in-process
/// workers have no link.
pub async fn run(config: WorkerConfig, link: Option<LinkWorker>) -> io::Result<()> {
    // Die with the runner, whatever happens to it.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let options = LockOptions::builder()
        .ttl(Duration::from_millis(config.ttl_ms))
        .request_timeout(Duration::from_millis(config.request_timeout_ms));
    let options = match config.lock_delay_ms {
        Some(ms) => options.lock_delay(Duration::from_millis(ms)),
        None => options,
    }
    .build()
    .map_err(io::Error::other)?;
    let bug = planted(config.bug.as_deref())?;
    let memory = config.url.starts_with("memory:");
    let link = match (memory, link) {
        (true, None) => {
            return Err(io::Error::other(
                "in-process workers need the harness's links (the leasehold-chaos program)",
            ));
        }
        (true, link) => link,
        (false, _) => None,
    };
    let shared: Option<Arc<dyn Backend>> = if memory {
        Some(Arc::new(leasehold::memory::InMemory::new()))
    } else {
        None
    };
    let mut tasks = Vec::new();
    // The in-process server's own report of its final state (no observer can reach it).
    let mut host: Option<Sink> = None;
    for (i, name) in config.processes.iter().enumerate() {
        let first_op = (u64::from(config.incarnation) + 1) << 32;
        let (sink, commands) = Sink::connect(config.collector, name, first_op).await?;
        sink.send(
            sink.event(Kind::Start, Phase::Info)
                .value(json!({"pid": std::process::id(), "incarnation": config.incarnation})),
        );
        let real: Arc<dyn Backend> = match &shared {
            Some(backend) => backend.clone(),
            None => connect(&config.url, &sink).await,
        };
        // A bug of the backend itself sits below the recorder, the others above it.
        let real = wrap_bug(bug, real, true);
        if shared.is_some() && host.is_none() {
            host = Some(sink.clone());
        }
        let recorded: Arc<dyn Backend> = Arc::new(Recorder::new(real, sink.clone()));
        let link = link.map(|link| link(recorded.clone()));
        let below_bug: Arc<dyn Backend> = match &link {
            Some(link) => link.backend(),
            None => recorded,
        };
        let top = wrap_bug(bug, below_bug, false);
        // A session backend's grants live as long as its session: its lease is the
        // session's, not one of ours.
        let options = if top.capabilities().has_sessions() {
            options
                .to_builder()
                .default_ttl()
                .build()
                .map_err(io::Error::other)?
        } else {
            options.clone()
        };
        let events = match &config.events_dir {
            Some(dir) => {
                let file = dir.join(format!("{name}.{}.jsonl", config.incarnation));
                Some(JsonLines::create(file).map_err(io::Error::other)?)
            }
            None => None,
        };
        let client = build_client(top, options, bug, events);
        let worker = Worker {
            name: name.clone(),
            config: config.clone(),
            client,
            sink,
            resource: ResourceClient::new(
                config.resource,
                Duration::from_millis(config.request_timeout_ms),
            ),
            rng: StdRng::seed_from_u64(config.seed.wrapping_add(i as u64 * 7919)),
            rounds: 0,
            last_owner: None,
        };
        tasks.push(tokio::spawn(worker.run(commands, link)));
    }
    for task in tasks {
        let _ = task.await;
    }
    if let (Some(backend), Some(sink)) = (&shared, &host) {
        final_look(backend.as_ref(), &config.lock, sink).await;
    }
    Ok(())
}

/// Reports what the in-process server shows once every worker has stopped.
/// It is the final inspection (C10) that an observer in another process cannot make.
async fn final_look(backend: &dyn Backend, lock: &str, sink: &Sink) {
    let Ok(name) = LockName::new(lock) else {
        return;
    };
    if let Ok(state) = backend.inspect(&name).await {
        let event = sink
            .event(Kind::Inspect, Phase::Info)
            .lock(lock)
            .value(crate::runner::holders_value(&state, true));
        // Waits for the collector's stamp: the process exits next.
        sink.invoke(event).await;
    }
}

/// Connects, retrying while the backend cannot be reached (the nemesis may be at work).
async fn connect(url: &str, sink: &Sink) -> Arc<dyn Backend> {
    let mut pause = Duration::from_millis(20);
    loop {
        match leasehold::connect_backend(url).await {
            Ok(backend) => return backend,
            Err(error) => {
                sink.send(
                    sink.event(Kind::Start, Phase::Info)
                        .error(format!("connecting: {error}")),
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }
}

#[cfg(feature = "planted-bugs")]
type PlantedBug = Option<crate::bugs::Bug>;
#[cfg(not(feature = "planted-bugs"))]
type PlantedBug = Option<std::convert::Infallible>;

fn planted(name: Option<&str>) -> io::Result<PlantedBug> {
    let Some(name) = name else {
        return Ok(None);
    };
    #[cfg(feature = "planted-bugs")]
    {
        crate::bugs::Bug::parse(name)
            .map(Some)
            .ok_or_else(|| io::Error::other(format!("no planted bug named {name:?}")))
    }
    #[cfg(not(feature = "planted-bugs"))]
    {
        Err(io::Error::other(format!(
            "planted bug {name:?}: this build has no planted bugs (feature `planted-bugs`)"
        )))
    }
}

/// Wraps `backend` in the planted bug if it belongs at this layer.
/// A bug of the backend itself goes below the recorder (`in_backend`), the others above it.
fn wrap_bug(bug: PlantedBug, backend: Arc<dyn Backend>, in_backend: bool) -> Arc<dyn Backend> {
    #[cfg(not(feature = "planted-bugs"))]
    let _ = in_backend;
    match bug {
        #[cfg(feature = "planted-bugs")]
        Some(bug) if bug.in_backend() == in_backend => bug.wrap(backend),
        #[allow(unreachable_patterns)]
        _ => backend,
    }
}

fn build_client(
    backend: Arc<dyn Backend>,
    options: LockOptions,
    bug: PlantedBug,
    events: Option<JsonLines>,
) -> Client {
    let builder = Client::builder_from_arc(backend).options(options);
    let builder = match events {
        Some(events) => builder.events(events),
        None => builder,
    };
    match bug {
        #[cfg(feature = "planted-bugs")]
        Some(crate::bugs::Bug::WallClock) => builder.clock(crate::bugs::WallClock).build(),
        #[allow(unreachable_patterns)]
        _ => builder.build(),
    }
}

struct Worker {
    name: String,
    config: WorkerConfig,
    client: Client,
    sink: Sink,
    resource: ResourceClient,
    rng: StdRng,
    rounds: u64,
    last_owner: Option<OwnerId>,
}

impl Worker {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        link: Option<Arc<dyn Link>>,
    ) {
        let (stop_tx, stop) = watch::channel(false);
        let listener = tokio::spawn(async move {
            while let Some(command) = commands.recv().await {
                match command {
                    Command::Stop => {
                        let _ = stop_tx.send(true);
                    }
                    Command::Link { action, delay_ms } => {
                        if let Some(link) = &link {
                            link.apply(&action, delay_ms);
                        }
                    }
                }
            }
            let _ = stop_tx.send(true);
        });
        let spin = self.config.spin.contains(&self.name);
        let rogue = self.config.rogue.contains(&self.name);
        let Ok(mutex) = self.client.mutex(&self.config.lock) else {
            return;
        };
        let side = self.hold_side_locks().await;
        while !*stop.borrow() {
            if rogue {
                self.rogue_releases().await;
            }
            let op = self.sink.next_op();
            self.sink
                .invoke(
                    self.sink
                        .event(Kind::Lock, Phase::Invoke)
                        .op(op)
                        .lock(self.config.lock.clone()),
                )
                .await;
            let wait = Duration::from_millis(self.config.wait_ms);
            let attempt = async {
                if spin {
                    mutex.try_lock().await
                } else {
                    mutex.lock_timeout(wait).await
                }
            };
            let mut stopping = stop.clone();
            let answer = tokio::select! {
                answer = attempt => Some(answer),
                _ = stopping.wait_for(|s| *s) => None,
            };
            let done = self.sink.event(Kind::Lock, Phase::Fail).op(op);
            match answer {
                None => {
                    self.sink.send(done.answer("stopped"));
                    break;
                }
                Some(Ok(Some(guard))) => {
                    let mut ok = self.sink.event(Kind::Lock, Phase::Ok).op(op);
                    ok = ok
                        .owner(guard.owner().to_string())
                        .token(guard.token().get());
                    self.sink.send(ok);
                    self.hold(guard, &stop).await;
                }
                Some(Ok(None)) => self.sink.send(done.answer("busy")),
                Some(Err(error)) => {
                    let mut event = done.error(error.to_string());
                    if error.is_unknown_outcome() {
                        event.phase = Some(Phase::Unknown);
                    }
                    self.sink.send(event);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let think = if spin {
                5
            } else {
                self.rng.random_range(0..=self.config.think_ms)
            };
            tokio::time::sleep(Duration::from_millis(think)).await;
        }
        for (guard, watcher) in side {
            watcher.abort();
            let _ = guard.release().await;
        }
        self.client.settle().await;
        listener.abort();
    }

    /// Takes the side names of the configuration, each watched for its loss.
    /// They make no `lock` events: they are not the lock.
    async fn hold_side_locks(&self) -> Vec<(leasehold::Guard, tokio::task::JoinHandle<()>)> {
        let mut held = Vec::new();
        for i in 0..self.config.side_locks {
            let name = format!("{}-side-{}-{i}", self.config.lock, self.name);
            let Ok(mutex) = self.client.mutex(&name) else {
                continue;
            };
            let guard = match mutex.lock().await {
                Ok(guard) => guard,
                Err(error) => {
                    // Never held: reported as lost (under no owner, so the live view's
                    // holder is left alone).
                    self.sink.send(
                        self.sink
                            .event(Kind::Lost, Phase::Info)
                            .lock(name)
                            .owner(String::new())
                            .error(format!("not taken: {error}")),
                    );
                    continue;
                }
            };
            let watcher = self.watch_loss(&guard);
            held.push((guard, watcher));
        }
        held
    }

    /// Reports the loss of `guard` as a `lost` event of its name.
    fn watch_loss(&self, guard: &leasehold::Guard) -> tokio::task::JoinHandle<()> {
        let lost = guard.lost();
        let sink = self.sink.clone();
        let (owner, lock, token) = (
            guard.owner().to_string(),
            guard.name().as_str().to_owned(),
            guard.token().get(),
        );
        tokio::spawn(async move {
            let reason = lost.await;
            let mut event = sink
                .event(Kind::Lost, Phase::Info)
                .lock(lock)
                .owner(owner)
                .token(token);
            event.fault = Some(format!("{reason:?}"));
            sink.send(event);
        })
    }

    /// Reads and writes under `guard`, then releases it.
    async fn hold(&mut self, guard: leasehold::Guard, stop: &watch::Receiver<bool>) {
        let owner = guard.owner().to_string();
        let token = guard.token().get();
        self.last_owner = Some(guard.owner().clone());
        let watcher = self.watch_loss(&guard);
        let (least, most) = self.config.rounds;
        let rounds = self.rng.random_range(least..=most.max(least));
        for _ in 0..rounds {
            if *stop.borrow() {
                break;
            }
            let Some(read) = self.access(&guard, Kind::Read, Value::Null).await else {
                break;
            };
            let next = self.next_value(read);
            if self.access(&guard, Kind::Write, next).await.is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(self.config.pause_ms)).await;
        }
        let op = self.sink.next_op();
        self.sink
            .invoke(
                self.sink
                    .event(Kind::Unlock, Phase::Invoke)
                    .op(op)
                    .owner(owner.clone())
                    .token(token),
            )
            .await;
        if self.config.still_owner {
            // The hold's transaction at the resource ends before the lock is given up.
            let end = ResourceRequest {
                op: "end".into(),
                id: op,
                worker: self.name.clone(),
                owner,
                token,
                value: Value::Null,
            };
            let _ = self.resource.call(&end).await;
        }
        let done = match guard.release().await {
            Ok(()) => self.sink.event(Kind::Unlock, Phase::Ok).op(op),
            Err(error) => self
                .sink
                .event(Kind::Unlock, Phase::Fail)
                .op(op)
                .error(error.to_string()),
        };
        self.sink.send(done);
        watcher.abort();
    }

    fn next_value(&mut self, read: Value) -> Value {
        self.rounds += 1;
        match self.config.workload {
            Workload::Counter => json!(read.as_i64().unwrap_or(0) + 1),
            Workload::Set => {
                let mut list = read.as_array().cloned().unwrap_or_default();
                list.push(json!(format!(
                    "{}.{}.{}",
                    self.name, self.config.incarnation, self.rounds
                )));
                Value::Array(list)
            }
        }
    }

    /// One fenced access: stamped, then the guard checked, then sent.
    /// `None` ends the hold (not held, refused, or no answer).
    async fn access(&self, guard: &leasehold::Guard, kind: Kind, value: Value) -> Option<Value> {
        let op = self.sink.next_op();
        let token = guard.token().get();
        let owner = guard.owner().to_string();
        let mut invoke = self
            .sink
            .event(kind, Phase::Invoke)
            .op(op)
            .lock(self.config.lock.clone())
            .owner(owner.clone())
            .token(token);
        if kind == Kind::Write {
            invoke = invoke.value(value.clone());
        }
        self.sink.invoke(invoke).await;
        let held = guard.is_held();
        let mut done = self.sink.event(kind, Phase::Fail).op(op);
        done.held = Some(held);
        if !held {
            self.sink.send(done.answer("not_held"));
            return None;
        }
        let request = ResourceRequest {
            op: if kind == Kind::Write { "write" } else { "read" }.into(),
            id: op,
            worker: self.name.clone(),
            owner,
            token,
            value,
        };
        match self.resource.call(&request).await {
            Access::Accepted(v) => {
                done.phase = Some(Phase::Ok);
                self.sink.send(done.answer("accepted").value(v.clone()));
                Some(v)
            }
            Access::Refused => {
                self.sink.send(done.answer("refused"));
                None
            }
            Access::Unknown(error) => {
                done.phase = Some(Phase::Unknown);
                self.sink.send(done.error(error));
                None
            }
        }
    }

    /// Releases the server must refuse.
    /// They go under a random owner id, and under this worker's previous owner id
    /// (superseded by now, or released).
    async fn rogue_releases(&self) {
        let Ok(name) = LockName::new(&self.config.lock) else {
            return;
        };
        let mut owners = vec![OwnerId::generate()];
        owners.extend(self.last_owner.clone());
        for owner in owners {
            let request = Request::new(
                name.clone(),
                owner,
                Mode::Exclusive,
                Duration::from_millis(self.config.ttl_ms),
            );
            let timeout = Duration::from_millis(self.config.request_timeout_ms);
            let _ = tokio::time::timeout(timeout, self.client.backend().release(&request)).await;
        }
    }
}
