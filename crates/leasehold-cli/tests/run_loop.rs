//! The run loop of `leasehold run`, on the in-memory backend with injected faults.
//! A lost lock stops the command's whole process group, signals are passed on, exit codes
//! are as documented, and nothing is left on the server.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use leasehold::memory::InMemory;
use leasehold::{Client, LockOptions};
use leasehold_cli::exit;
use leasehold_cli::run::{Hold, RunSpec, WaitFor, hold, run};
use leasehold_testkit::faulty::{Faulty, Op};
use rustix::process::{Pid, test_kill_process};
use tokio::sync::oneshot;

fn spec(command: &[&str]) -> RunSpec {
    RunSpec {
        names: vec!["job".into()],
        hold: Hold::Exclusive,
        campaign: None,
        wait: WaitFor::Forever,
        job: None,
        at_least: None,
        at_most: None,
        options: LockOptions::builder()
            .ttl(Duration::from_millis(600))
            .build()
            .unwrap(),
        grace: Duration::from_millis(300),
        command: command.iter().map(OsString::from).collect(),
        supervisor: env!("CARGO_BIN_EXE_leasehold").into(),
    }
}

/// A FIFO the command writes its pid into; reading it waits for the command to start.
struct Ready {
    _dir: tempfile::TempDir,
    fifo: PathBuf,
}

impl Ready {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ready");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        Self { _dir: dir, fifo }
    }

    fn path(&self) -> &Path {
        &self.fifo
    }

    /// Waits until the command has written its pid.
    async fn pid(&self) -> Pid {
        let fifo = self.fifo.clone();
        let text = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
            .await
            .unwrap()
            .unwrap();
        Pid::from_raw(text.trim().parse().unwrap()).unwrap()
    }
}

/// A pair: the future given to `run` as its interrupt, and the sender that fires it.
fn interrupt() -> (oneshot::Sender<i32>, impl Future<Output = i32> + Send) {
    let (tx, rx) = oneshot::channel();
    (tx, async move {
        match rx.await {
            Ok(signal) => signal,
            Err(_) => std::future::pending().await,
        }
    })
}

fn gone(pid: Pid) -> bool {
    test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
}

#[tokio::test]
async fn losing_the_lock_stops_the_command_and_exits_80() {
    let faults = Faulty::new(InMemory::new());
    let client = Client::new(faults.clone());
    faults.hold_requests(Op::Renew);
    let ready = Ready::new();
    let script = format!("echo $$ > {}; exec sleep 1000", ready.path().display());
    let spec = spec(&["sh", "-c", &script]);
    let (_tx, interrupted) = interrupt();
    let running =
        tokio::spawn(async move { run(&client, &spec, std::pin::pin!(interrupted)).await });
    let pid = ready.pid().await;
    assert!(!gone(pid));
    assert_eq!(running.await.unwrap(), exit::LOST);
    assert!(gone(pid), "the command outlived the lock");
}

/// The grace fits inside the lease.
/// A command that ignores SIGTERM gets it `grace` before the lease's deadline, while the
/// lock is still held, and is killed by the deadline — not given a fresh grace once the
/// loss is signalled.
#[tokio::test]
async fn a_command_ignoring_sigterm_gets_it_before_the_deadline_and_is_killed_by_it() {
    let faults = Faulty::new(InMemory::new());
    let client = Client::new(faults.clone());
    faults.hold_requests(Op::Renew);
    let ready = Ready::new();
    let events = ready.path().with_file_name("events");
    // The shell notes each SIGTERM and carries on (its `sleep` dies of it; the next one
    // starts).
    let script = format!(
        "trap 'echo term >> {}' TERM; echo $$ > {}; while :; do sleep 1; done",
        events.display(),
        ready.path().display()
    );
    let mut spec = spec(&["sh", "-c", &script]);
    spec.options = LockOptions::builder()
        .ttl(Duration::from_secs(3))
        .build()
        .unwrap();
    spec.grace = Duration::from_secs(1);
    let guard = client
        .mutex("job")
        .unwrap()
        .with_options(spec.options.clone())
        .lock()
        .await
        .unwrap();
    let lost = guard.lost();
    let (_tx, interrupted) = interrupt();
    let running = tokio::spawn(async move {
        hold(&client, &spec, guard.into(), std::pin::pin!(interrupted)).await
    });
    let pid = ready.pid().await;
    lost.await;
    let seen = std::fs::read_to_string(&events).unwrap_or_default();
    assert_eq!(
        seen.lines().next(),
        Some("term"),
        "the command had no SIGTERM before the lock was lost"
    );
    assert_eq!(running.await.unwrap(), exit::LOST);
    assert!(gone(pid), "SIGKILL did not follow the ignored SIGTERM");
}

/// The command starts only if the lock is still held, with its grace still ahead.
/// A grant whose reply came so late that its deadline is nearer than `grace` does not run
/// it.
#[tokio::test]
async fn a_grant_running_out_before_the_command_starts_does_not_start_it() {
    let server = InMemory::new();
    let faults = Faulty::new(server.clone());
    let client = Client::new(faults.clone());
    let observer = Client::new(server);
    // Of the 600 ms lease (592 ms after the drift allowance) the reply leaves less than the
    // 300 ms grace; no renewal moves the deadline.
    faults.delay_replies(Op::Acquire, Duration::from_millis(400));
    faults.hold_requests(Op::Renew);
    let marker = tempfile::tempdir().unwrap();
    let touched = marker.path().join("ran");
    let spec = spec(&["touch", touched.to_str().unwrap()]);
    let (_tx, interrupted) = interrupt();
    assert_eq!(
        run(&client, &spec, std::pin::pin!(interrupted)).await,
        exit::LOST
    );
    assert!(!touched.exists(), "the command ran without its lock");
    client.settle().await;
    assert!(observer.inspect("job").await.unwrap().holders.is_empty());
}

#[tokio::test]
async fn the_command_sees_the_lock_and_token_and_its_exit_code_passes_through() {
    let server = InMemory::new();
    let client = Client::new(server.clone());
    let spec = spec(&[
        "sh",
        "-c",
        r#"test "$LEASEHOLD_LOCK" = job && test "$LEASEHOLD_TOKEN" -ge 1 && test -n "$LEASEHOLD_OWNER" && exit 7"#,
    ]);
    let (_tx, interrupted) = interrupt();
    assert_eq!(run(&client, &spec, std::pin::pin!(interrupted)).await, 7);
    // Released afterwards.
    assert!(client.inspect("job").await.unwrap().holders.is_empty());
}

#[tokio::test]
async fn a_command_killed_by_a_signal_exits_128_plus_the_signal() {
    let client = Client::new(InMemory::new());
    let spec = spec(&["sh", "-c", "kill -KILL $$"]);
    let (_tx, interrupted) = interrupt();
    assert_eq!(
        run(&client, &spec, std::pin::pin!(interrupted)).await,
        128 + 9
    );
}

#[tokio::test]
async fn busy_without_waiting_exits_75_and_runs_nothing() {
    let server = InMemory::new();
    let holder = Client::new(server.clone());
    let _held = holder.mutex("job").unwrap().lock().await.unwrap();
    let client = Client::new(server);
    let marker = tempfile::tempdir().unwrap();
    let touched = marker.path().join("ran");
    let mut spec = spec(&["touch", touched.to_str().unwrap()]);
    spec.wait = WaitFor::No;
    let (_tx, interrupted) = interrupt();
    assert_eq!(
        run(&client, &spec, std::pin::pin!(interrupted)).await,
        exit::NOT_ACQUIRED
    );
    spec.wait = WaitFor::UpTo(Duration::from_millis(100));
    let (_tx, interrupted) = interrupt();
    assert_eq!(
        run(&client, &spec, std::pin::pin!(interrupted)).await,
        exit::NOT_ACQUIRED
    );
    assert!(!touched.exists(), "the command ran without the lock");
}

#[tokio::test]
async fn an_interrupt_while_waiting_leaves_nothing_behind() {
    let server = InMemory::new();
    let holder = Client::new(server.clone());
    let held = holder.mutex("job").unwrap().lock().await.unwrap();
    let faults = Faulty::new(server.clone());
    let client = Client::new(faults.clone());
    let spec = spec(&["true"]);
    let (tx, interrupted) = interrupt();
    let running =
        tokio::spawn(async move { run(&client, &spec, std::pin::pin!(interrupted)).await });
    faults.until_calls(Op::Wait, 1).await;
    assert_eq!(holder.inspect("job").await.unwrap().waiters.len(), 1);
    tx.send(2).unwrap();
    assert_eq!(running.await.unwrap(), 130);
    let state = holder.inspect("job").await.unwrap();
    assert!(state.waiters.is_empty());
    assert_eq!(state.holders.len(), 1);
    assert_eq!(&state.holders[0].owner, held.owner());
}

#[tokio::test]
async fn an_interrupt_while_running_stops_the_command_and_releases() {
    let server = InMemory::new();
    let client = Client::new(server.clone());
    let observer = Client::new(server);
    let ready = Ready::new();
    let script = format!("echo $$ > {}; exec sleep 1000", ready.path().display());
    let spec = spec(&["sh", "-c", &script]);
    let (tx, interrupted) = interrupt();
    let running =
        tokio::spawn(async move { run(&client, &spec, std::pin::pin!(interrupted)).await });
    let pid = ready.pid().await;
    assert_eq!(observer.inspect("job").await.unwrap().holders.len(), 1);
    tx.send(15).unwrap();
    assert_eq!(running.await.unwrap(), 143);
    assert!(gone(pid));
    assert!(observer.inspect("job").await.unwrap().holders.is_empty());
}

#[tokio::test]
async fn a_missing_command_exits_127_and_releases() {
    let server = InMemory::new();
    let client = Client::new(server.clone());
    let spec = spec(&["/nonexistent/leasehold-test-command"]);
    let (_tx, interrupted) = interrupt();
    assert_eq!(
        run(&client, &spec, std::pin::pin!(interrupted)).await,
        exit::NOT_FOUND
    );
    assert!(client.inspect("job").await.unwrap().holders.is_empty());
}

#[tokio::test]
async fn shared_and_permit_holds_run_side_by_side() {
    let server = InMemory::new();
    let a = Client::new(server.clone());
    let b = Client::new(server);
    for hold in [Hold::Shared, Hold::Permits(2)] {
        // Two commands that can only both finish if they run at the same time: each waits
        // for the other's marker.
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (dir.path().join("one"), dir.path().join("two"));
        let script = |mine: &Path, theirs: &Path| {
            format!(
                "touch {}; while [ ! -e {} ]; do sleep 0.01; done",
                mine.display(),
                theirs.display()
            )
        };
        let mut first = spec(&["sh", "-c", &script(&one, &two)]);
        let mut second = spec(&["sh", "-c", &script(&two, &one)]);
        first.hold = hold;
        second.hold = hold;
        let (_t1, i1) = interrupt();
        let (_t2, i2) = interrupt();
        let (a, b) = (a.clone(), b.clone());
        let runs = tokio::time::timeout(
            Duration::from_secs(20),
            futures_join(
                async move { run(&a, &first, std::pin::pin!(i1)).await },
                async move { run(&b, &second, std::pin::pin!(i2)).await },
            ),
        )
        .await
        .expect("the two holders were not let in together");
        assert_eq!(runs, (0, 0), "{hold:?}");
    }
}

async fn futures_join<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    tokio::join!(a, b)
}
