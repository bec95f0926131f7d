//! The nemesis: faults a scenario injects, each recorded in the history.
//! Each is recorded as invoke when it starts, ok when it ends, and undone at the end of the
//! run.
//!
//! Workers are paused, resumed, killed and restarted as processes; their links to the
//! servers are cut, delayed, jittered and reset through their own fault proxies (or, for
//! the in-memory backend, through the harness's link of the worker); servers are
//! paused, killed and restarted; Redis is flushed, evicted and failed over; client wall
//! clocks jump through libfaketime.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use leasehold_faultproxy::Direction;
use rand::Rng;
use rand::rngs::StdRng;
use rustix::process::{Pid, Signal, kill_process};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::collector::{Collector, LiveView};
use crate::deploy::Deployment;
use crate::harness::Servers;
use crate::history::{Event, Kind, Phase};
use crate::wire::Command;
use crate::worker::WorkerConfig;

/// A worker process of the run.
#[derive(Debug)]
pub(crate) struct WorkerProcess {
    /// The workers it hosts.
    pub(crate) names: Vec<String>,
    pub(crate) child: Option<tokio::process::Child>,
    pub(crate) config: WorkerConfig,
    /// The file libfaketime reads this process's clock offset from.
    pub(crate) faketime: Option<PathBuf>,
    /// The offset its clock starts with and returns to, in ms (0 unless skewed).
    pub(crate) clock_base_ms: i64,
}

impl WorkerProcess {
    pub(crate) fn pid(&self) -> Option<Pid> {
        self.child
            .as_ref()
            .and_then(tokio::process::Child::id)
            .and_then(|p| Pid::from_raw(p as i32))
    }

    fn signal(&self, signal: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill_process(pid, signal);
        }
    }
}

/// Starts worker processes (the runner provides it).
pub(crate) type Spawner =
    Box<dyn Fn(&WorkerConfig, Option<&PathBuf>) -> io::Result<tokio::process::Child> + Send + Sync>;

/// A fault in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a fault is recorded as ending when `end` is called"]
pub struct FaultId(u64);

/// A link fault.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Link {
    /// Hold every byte in one or both directions.
    Cut(Direction),
    /// Delay every byte both ways by this much.
    Delay(Duration),
    /// Lose the next acquire reply, or close connections with RST after holding replies.
    /// The first on in-process links, the second on the network.
    Reset,
    /// Refuse new connections.
    Refuse,
    /// Undo everything.
    Heal,
}

/// The run's parameters a schedule works with.
#[derive(Debug)]
pub(crate) struct Schedule {
    pub(crate) rng: StdRng,
    pub(crate) ttl: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) lock: String,
}

/// What a scenario works with.
pub struct Ctx<'a> {
    /// The scenario's random choices (seeded).
    pub rng: StdRng,
    /// The run's lease.
    pub ttl: Duration,
    /// The engine's request timeout.
    pub request_timeout: Duration,
    pub(crate) collector: &'a Collector,
    pub(crate) deployment: &'a mut Deployment,
    pub(crate) workers: &'a mut Vec<WorkerProcess>,
    pub(crate) spawner: &'a Spawner,
    pub(crate) lock: String,
    view: watch::Receiver<LiveView>,
    next_fault: u64,
    open: BTreeMap<u64, (String, String)>,
    paused_workers: BTreeSet<String>,
    paused_servers: BTreeSet<usize>,
    /// How many faults were injected.
    pub(crate) injected: usize,
    /// Workers killed (their leases must lapse before the final inspection).
    pub(crate) killed: bool,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(
        schedule: Schedule,
        collector: &'a Collector,
        deployment: &'a mut Deployment,
        workers: &'a mut Vec<WorkerProcess>,
        spawner: &'a Spawner,
    ) -> Self {
        let Schedule {
            rng,
            ttl,
            request_timeout,
            lock,
        } = schedule;
        Ctx {
            rng,
            ttl,
            request_timeout,
            view: collector.view(),
            collector,
            deployment,
            workers,
            spawner,
            lock,
            next_fault: 1,
            open: BTreeMap::new(),
            paused_workers: BTreeSet::new(),
            paused_servers: BTreeSet::new(),
            injected: 0,
            killed: false,
        }
    }

    /// Sleeps.
    ///
    /// # Cancel safety
    ///
    /// Nothing to undo.
    pub async fn sleep(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    /// `ttl × factor`.
    pub fn ttls(&self, factor: f64) -> Duration {
        self.ttl.mul_f64(factor)
    }

    /// A random duration between `lo` and `hi` ttls.
    pub fn random_ttls(&mut self, lo: f64, hi: f64) -> Duration {
        let f = self.rng.random_range(lo..=hi);
        self.ttls(f)
    }

    /// The workers' names.
    pub fn worker_names(&self) -> Vec<String> {
        self.workers.iter().flat_map(|w| w.names.clone()).collect()
    }

    /// Records the start of a fault.
    pub fn begin(&mut self, action: &str, target: &str, detail: Value) -> FaultId {
        let id = self.next_fault;
        self.next_fault += 1;
        self.injected += 1;
        let mut e = Event::new("nemesis", Kind::Fault, Phase::Invoke)
            .op(id)
            .value(detail);
        e.fault = Some(action.to_owned());
        e.target = Some(target.to_owned());
        self.collector.record(e);
        self.open.insert(id, (action.to_owned(), target.to_owned()));
        FaultId(id)
    }

    /// Records the end of a fault.
    pub fn end(&mut self, fault: FaultId) {
        if let Some((action, target)) = self.open.remove(&fault.0) {
            let mut e = Event::new("nemesis", Kind::Fault, Phase::Ok).op(fault.0);
            e.fault = Some(action);
            e.target = Some(target);
            self.collector.record(e);
        }
    }

    /// A fault that happens at once.
    pub fn instant(&mut self, action: &str, target: &str, detail: Value) {
        let f = self.begin(action, target, detail);
        self.end(f);
    }

    /// Waits until `pred` holds on the live view, at most `limit`.
    async fn until<T>(
        &mut self,
        limit: Duration,
        mut pred: impl FnMut(&LiveView) -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(found) = pred(&self.view.borrow_and_update()) {
                return Some(found);
            }
            tokio::select! {
                changed = self.view.changed() => if changed.is_err() { return None },
                () = tokio::time::sleep_until(deadline) => return None,
                // Holders age without events: look again now and then.
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    }

    /// A worker that has held the lock for at least `min`, waiting up to `limit`.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn holder(&mut self, min: Duration, limit: Duration) -> Option<String> {
        let collector = self.collector;
        let min = min.as_micros() as u64;
        self.until(limit, |v| {
            let now = collector.now();
            v.holders
                .iter()
                .find(|(_, h)| now.saturating_sub(h.since) >= min)
                .map(|(name, _)| name.clone())
        })
        .await
    }

    /// A worker inside a lock call that does not hold, waiting up to `limit`.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn waiter(&mut self, limit: Duration) -> Option<String> {
        self.until(limit, |v| {
            v.waiting
                .iter()
                .find(|w| !v.holders.contains_key(*w))
                .cloned()
        })
        .await
    }

    /// Whether `worker` holds now.
    pub fn holds(&self, worker: &str) -> bool {
        self.view.borrow().holders.contains_key(worker)
    }

    /// The owner id of `worker`'s guard, if it holds now.
    pub fn owner_of(&self, worker: &str) -> Option<String> {
        self.view
            .borrow()
            .holders
            .get(worker)
            .map(|h| h.owner.clone())
    }

    /// Until the resource has answered an access of `worker` under the guard it holds.
    /// It waits at most `limit`, and returns that guard's owner id.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn until_accessed(&mut self, worker: &str, limit: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // The view, then the history, never both at once: recording an event takes the
            // history's lock, then the view's.
            let owner = self
                .view
                .borrow_and_update()
                .holders
                .get(worker)
                .map(|h| h.owner.clone());
            if let Some(owner) = owner
                && self
                    .collector
                    .history()
                    .of(Kind::Apply)
                    .any(|e| e.owner.as_ref() == Some(&owner))
            {
                return Some(owner);
            }
            tokio::select! {
                changed = self.view.changed() => if changed.is_err() { return None },
                () = tokio::time::sleep_until(deadline) => return None,
                // Accesses do not change the view: look again now and then.
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    }

    /// The names other than the lock whose guards were lost, as `worker: name`.
    /// Those of `paused` from `since` on (collector time) are left out.
    pub fn lost_elsewhere(&self, paused: &str, since: u64) -> Vec<String> {
        self.collector
            .history()
            .of(Kind::Lost)
            .filter(|e| e.lock.as_deref().is_some_and(|l| l != self.lock))
            .filter(|e| !(e.process == paused && e.t >= since))
            .map(|e| format!("{}: {}", e.process, e.lock.as_deref().unwrap_or_default()))
            .collect()
    }

    fn process_of(&self, worker: &str) -> Option<usize> {
        self.workers
            .iter()
            .position(|w| w.names.iter().any(|n| n == worker))
    }

    /// SIGSTOP the worker's process.
    pub fn pause_worker(&mut self, worker: &str) -> FaultId {
        let f = self.begin("pause", worker, json!({}));
        if let Some(i) = self.process_of(worker) {
            self.workers[i].signal(Signal::STOP);
        }
        self.paused_workers.insert(worker.to_owned());
        f
    }

    /// SIGCONT the worker's process, ending `fault`.
    pub fn resume_worker(&mut self, worker: &str, fault: FaultId) {
        if let Some(i) = self.process_of(worker) {
            self.workers[i].signal(Signal::CONT);
        }
        self.paused_workers.remove(worker);
        self.end(fault);
    }

    /// SIGKILL the worker's process.
    ///
    /// # Cancel safety
    ///
    /// The signal is sent before the first await; dropping the future leaves the process
    /// unreaped until the run ends.
    pub async fn kill_worker(&mut self, worker: &str) {
        let f = self.begin("kill", worker, json!({}));
        if let Some(i) = self.process_of(worker)
            && let Some(mut child) = self.workers[i].child.take()
        {
            let _ = child.kill().await;
        }
        self.killed = true;
        self.end(f);
    }

    /// Starts a killed worker again.
    ///
    /// # Errors
    ///
    /// If the process cannot be started.
    pub fn restart_worker(&mut self, worker: &str) -> io::Result<()> {
        let Some(i) = self.process_of(worker) else {
            return Ok(());
        };
        let w = &mut self.workers[i];
        if w.child.is_some() {
            return Ok(());
        }
        w.config.incarnation += 1;
        w.child = Some((self.spawner)(&w.config, w.faketime.as_ref())?);
        let incarnation = w.config.incarnation;
        self.instant("restart", worker, json!({"incarnation": incarnation}));
        Ok(())
    }

    /// Moves the worker's wall clock `by_s` seconds from where it started.
    /// 0 puts it back (to its skew, if the run has one). Its monotonic clocks are untouched.
    pub fn jump_clock(&mut self, worker: &str, by_s: i64) {
        if let Some(i) = self.process_of(worker)
            && let Some(file) = &self.workers[i].faketime
        {
            let base = self.workers[i].clock_base_ms;
            let _ = crate::runner::set_clock(file, base.saturating_add(by_s.saturating_mul(1000)));
            self.instant("clock", worker, json!({"offset": format!("{by_s:+}")}));
        }
    }

    /// Whether workers run under libfaketime.
    pub fn clocks_faked(&self) -> bool {
        self.workers.iter().any(|w| w.faketime.is_some())
    }

    /// Applies a link fault between `worker` and every server.
    pub fn link(&mut self, worker: &str, fault: Link) {
        let nodes: Vec<usize> = (0..self.node_links(worker)).collect();
        self.link_nodes(worker, &nodes, fault);
    }

    fn node_links(&self, worker: &str) -> usize {
        self.worker_index(worker)
            .and_then(|w| self.deployment.proxies.get(w))
            .map_or(1, Vec::len)
    }

    fn worker_index(&self, worker: &str) -> Option<usize> {
        worker
            .strip_prefix('w')?
            .parse::<usize>()
            .ok()?
            .checked_sub(1)
    }

    /// Applies a link fault between `worker` and the servers `nodes`.
    pub fn link_nodes(&mut self, worker: &str, nodes: &[usize], fault: Link) {
        let action = match fault {
            Link::Cut(Direction::ToServer) => "cut-to-server",
            Link::Cut(Direction::ToClient) => "cut-to-client",
            Link::Cut(Direction::Both) => "cut-both",
            Link::Delay(_) => "delay",
            Link::Reset => "reset",
            Link::Refuse => "refuse",
            Link::Heal => "heal",
        };
        let delay_ms = match fault {
            Link::Delay(d) => d.as_millis() as u64,
            _ => 0,
        };
        let target = format!("link {worker}");
        // Delays are changed often by jitter: recorded only when they start or stop.
        if !matches!(fault, Link::Delay(_)) {
            self.instant(
                action,
                &target,
                json!({"nodes": nodes, "delay_ms": delay_ms}),
            );
        }
        match self
            .worker_index(worker)
            .and_then(|w| self.deployment.proxies.get(w))
        {
            Some(proxies) if !proxies.is_empty() => {
                for proxy in nodes.iter().filter_map(|n| proxies.get(*n)) {
                    match fault {
                        Link::Cut(direction) => proxy.cut(direction),
                        Link::Delay(d) => proxy.set_delay(Direction::Both, d),
                        Link::Reset => proxy.reset(),
                        Link::Refuse => {
                            proxy.refuse_new(true);
                            proxy.reset();
                        }
                        Link::Heal => proxy.heal(),
                    }
                }
            }
            _ => {
                // In-process workers: the harness's link of the worker.
                let action = match fault {
                    Link::Cut(Direction::ToServer) => "cut_to_server",
                    Link::Cut(Direction::ToClient) => "cut_to_client",
                    Link::Cut(Direction::Both) => "cut_both",
                    Link::Delay(_) => "delay",
                    Link::Reset | Link::Refuse => "reset",
                    Link::Heal => "heal",
                };
                self.collector.command(
                    worker,
                    Command::Link {
                        action: action.into(),
                        delay_ms,
                    },
                );
            }
        }
    }

    /// Whether the workers share one process rather than being processes of their own.
    /// Such workers are linked to their server by the harness (`Faulty`).
    pub fn in_process(&self) -> bool {
        !self.deployment.spec.traits.processes
    }

    /// The backend's name.
    pub fn backend(&self) -> &'static str {
        self.deployment.spec.name
    }

    /// What the backend is made of.
    pub fn traits(&self) -> crate::deploy::Traits {
        self.deployment.spec.traits
    }

    /// Until `worker` holds, at most `limit`.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn until_holds(&mut self, worker: &str, limit: Duration) -> bool {
        self.until(limit, |v| v.holders.contains_key(worker).then_some(()))
            .await
            .is_some()
    }

    /// A worker whose current guard was granted after `after` (collector time).
    /// It is held at least `min`; the wait is up to `limit`.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn holder_since(
        &mut self,
        after: u64,
        min: Duration,
        limit: Duration,
    ) -> Option<String> {
        let collector = self.collector;
        let min = min.as_micros() as u64;
        self.until(limit, |v| {
            let now = collector.now();
            v.holders
                .iter()
                .find(|(_, h)| h.since > after && now.saturating_sub(h.since) >= min)
                .map(|(name, _)| name.clone())
        })
        .await
    }

    /// Until `worker`'s lease is renewed after `after` (collector time), at most `limit`.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn until_renewed(&mut self, worker: &str, after: u64, limit: Duration) -> bool {
        self.until(limit, |v| {
            v.renewed
                .get(worker)
                .is_some_and(|t| *t > after)
                .then_some(())
        })
        .await
        .is_some()
    }

    /// The collector's clock now.
    pub fn now(&self) -> u64 {
        self.collector.now()
    }

    /// Jitters links: for `total`, every `step`, a random delay up to `max` each way.
    /// Each of `workers`' links to `nodes` (all if empty) gets one.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the last delays in place until the run's clean-up.
    pub async fn jitter(
        &mut self,
        workers: &[String],
        nodes: &[usize],
        max: Duration,
        step: Duration,
        total: Duration,
    ) {
        let f = self.begin(
            "jitter",
            "links",
            json!({"workers": workers, "max_ms": max.as_millis() as u64, "step_ms": step.as_millis() as u64}),
        );
        let end = tokio::time::Instant::now() + total;
        while tokio::time::Instant::now() < end {
            for w in workers {
                let delay = max.mul_f64(self.rng.random_range(0.0..=1.0));
                let nodes: Vec<usize> = if nodes.is_empty() {
                    (0..self.node_links(w)).collect()
                } else {
                    nodes.to_vec()
                };
                self.link_nodes(w, &nodes, Link::Delay(delay));
            }
            tokio::time::sleep(step).await;
        }
        for w in workers {
            let nodes: Vec<usize> = (0..self.node_links(w)).collect();
            self.link_nodes(w, &nodes, Link::Delay(Duration::ZERO));
        }
        self.end(f);
    }

    /// Loses the next acquire reply of an in-process worker (the request is applied).
    pub fn lose_next_reply(&mut self, worker: &str) {
        self.instant("lose-reply", &format!("link {worker}"), json!({}));
        self.collector.command(
            worker,
            Command::Link {
                action: "lose_reply".into(),
                delay_ms: 0,
            },
        );
    }

    /// The number of server processes.
    pub fn servers(&mut self) -> usize {
        self.deployment.servers.count()
    }

    /// The member that leads (etcd, ZooKeeper), else 0.
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    pub async fn leader(&mut self) -> usize {
        self.deployment.servers.leader().await
    }

    /// The server that serves the run's lock now (see [`Servers::serving`]).
    ///
    /// # Cancel safety
    ///
    /// Read-only.
    ///
    /// # Errors
    ///
    /// If the servers cannot tell.
    pub async fn serving(&mut self) -> io::Result<usize> {
        let key = self.lock_key();
        self.deployment.servers.serving(&key).await
    }

    /// SIGSTOP server `i`.
    pub fn pause_server(&mut self, i: usize) -> FaultId {
        let f = self.begin("pause", &format!("server {i}"), json!({}));
        self.deployment.servers.pause(i);
        self.paused_servers.insert(i);
        f
    }

    /// SIGCONT server `i`, ending `fault`.
    pub fn resume_server(&mut self, i: usize, fault: FaultId) {
        self.deployment.servers.resume(i);
        self.paused_servers.remove(&i);
        self.end(fault);
    }

    /// SIGKILL server `i`.
    pub fn kill_server(&mut self, i: usize) -> FaultId {
        let f = self.begin("kill", &format!("server {i}"), json!({}));
        self.deployment.servers.kill(i);
        f
    }

    /// Starts server `i` again (a redis-server comes back empty), ending `fault`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the server starting, and the fault open.
    ///
    /// # Errors
    ///
    /// If it does not come back.
    pub async fn restart_server(&mut self, i: usize, fault: FaultId) -> io::Result<()> {
        let restarted = self.deployment.servers.restart(i).await;
        self.end(fault);
        restarted
    }

    /// Runs a command on redis-server `i` (as an administrator would); its reply as text.
    ///
    /// # Cancel safety
    ///
    /// A command already sent is applied.
    ///
    /// # Errors
    ///
    /// If the server is not a redis-server or does not answer.
    pub async fn redis(&mut self, i: usize, args: &[&str]) -> io::Result<Option<String>> {
        self.deployment.servers.redis(i, args).await
    }

    /// The redis key of the run's lock.
    pub fn lock_key(&self) -> String {
        format!("leasehold:{{{}}}:lock", self.lock)
    }

    /// Expires the lock's key on redis-server `i` now, as a forward jump of its clock would.
    /// The jump would take the key past its lease; libfaketime hangs redis-server.
    ///
    /// # Cancel safety
    ///
    /// As for [`redis`](Ctx::redis).
    ///
    /// # Errors
    ///
    /// If the server does not answer.
    pub async fn expire_early(&mut self, i: usize) -> io::Result<()> {
        let key = self.lock_key();
        self.instant(
            "clock-jump",
            &format!("server {i}"),
            json!({"emulated_by": "PEXPIRE of the lock key", "key": key}),
        );
        self.redis(i, &["PEXPIRE", &key, "1"]).await.map(|_| ())
    }

    /// Moves server `i`'s wall clock `seconds` away from the real one (libfaketime).
    ///
    /// # Errors
    ///
    /// If the server's clock cannot be moved (libfaketime is not installed).
    pub fn jump_wall_clock(&mut self, i: usize, seconds: i64) -> io::Result<()> {
        self.deployment.servers.set_wall_clock(i, seconds)?;
        self.instant(
            "clock-jump",
            &format!("server {i}"),
            json!({"by_s": seconds, "via": "libfaketime"}),
        );
        Ok(())
    }

    /// Holds back replication from the primary, or drops what was held back (`false`).
    /// The bytes are kept in the replication link; once dropped, the link stays closed: the
    /// primary is gone.
    pub fn hold_replication(&mut self, hold: bool) {
        if let Some(link) = self.deployment.servers.replication() {
            if hold {
                link.cut(Direction::ToClient);
            } else {
                // Closed with what it held; left cut, so that nothing held can slip
                // through while the connections close.
                link.reset();
            }
            self.instant(
                if hold {
                    "hold-replication"
                } else {
                    "drop-replication"
                },
                "server 1",
                json!({}),
            );
        }
    }

    /// Points the movable address at server `i` (after a failover).
    pub fn switch_vip(&mut self, i: usize) {
        let endpoints = self.deployment.servers.endpoints();
        if let (Some(vip), Some(addr)) = (&self.deployment.vip, endpoints.get(i)) {
            vip.switch(*addr);
            self.instant(
                "failover",
                &format!("server {i}"),
                json!({"vip": addr.to_string()}),
            );
        }
    }

    /// The URL of the backend (no proxies).
    pub fn deployment_url(&self) -> String {
        self.deployment.observer_url.clone()
    }

    /// The servers, for scenario-specific administration.
    pub fn deployment_servers(&mut self) -> &mut dyn Servers {
        self.deployment.servers.as_mut()
    }

    /// Undoes every fault still in place.
    /// It resumes paused workers and servers, heals every link, puts clocks back. Recorded
    /// as the end of each open fault.
    pub(crate) async fn cleanup(&mut self) {
        for worker in std::mem::take(&mut self.paused_workers) {
            if let Some(i) = self.process_of(&worker) {
                self.workers[i].signal(Signal::CONT);
            }
        }
        for i in std::mem::take(&mut self.paused_servers) {
            self.deployment.servers.resume(i);
        }
        for proxies in &self.deployment.proxies {
            for p in proxies {
                p.heal();
                p.refuse_new(false);
            }
        }
        for name in self.worker_names() {
            if self.deployment.proxies.is_empty() {
                self.collector.command(
                    &name,
                    Command::Link {
                        action: "heal".into(),
                        delay_ms: 0,
                    },
                );
            }
        }
        for w in self.workers.iter() {
            if let Some(file) = &w.faketime {
                let _ = crate::runner::set_clock(file, w.clock_base_ms);
            }
        }
        for id in self.open.keys().copied().collect::<Vec<_>>() {
            self.end(FaultId(id));
        }
    }
}
