//! What the binary's end-to-end tests share.

use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::process::{Pid, PidfdFlags, Signal, kill_process, pidfd_open, test_kill_process_group};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

/// Starts 20 `leasehold run --url url` processes at once on one name.
/// Each does a slow read-increment-write of a counter file; the counter must end at exactly
/// 20 and the tokens the commands saw, in the order they ran, strictly increase.
pub(crate) async fn twenty_runs_share_a_counter(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("counter");
    let tokens = dir.path().join("tokens");
    std::fs::write(&counter, "0\n").unwrap();
    // Read, pause, write: without mutual exclusion, increments get lost.
    let script = format!(
        r#"n=$(cat {c}); echo "$LEASEHOLD_TOKEN" >> {t}; sleep 0.02; echo $((n + 1)) > {c}"#,
        c = counter.display(),
        t = tokens.display()
    );
    let args = ["run", "--url", url, "counter", "--", "sh", "-c", &script];
    let children: Vec<_> = (0..20)
        .map(|_| {
            Command::new(BIN)
                .args(args)
                .env_remove("LEASEHOLD_URL")
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output()
        })
        .collect();
    for child in children {
        let out = child.await.unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(std::fs::read_to_string(&counter).unwrap().trim(), "20");
    let seen: Vec<u64> = std::fs::read_to_string(&tokens)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(seen.len(), 20);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens in the order the commands ran: {seen:?}"
    );
}

/// `leasehold SUBCOMMAND --url url ARGS…` (`args[0]` is the subcommand), killed if dropped.
#[allow(dead_code, reason = "not every test file uses it")]
pub(crate) fn leasehold_on(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    command
        .arg(args[0])
        .args(["--url", url])
        .args(&args[1..])
        .env_remove("LEASEHOLD_URL")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// `leasehold elect` on `url`: candidates lead one at a time.
/// Each runs its command with its term as the token; `elect --observe --json` prints each
/// leader as it changes.
#[allow(dead_code, reason = "not every test file runs elections")]
pub(crate) async fn elect_hands_on_leadership_and_observers_see_each_leader(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let leasehold = |args: &[&str]| leasehold_on(url, args);
    let mut observer = leasehold(&["elect", "--observe", "--json", "sched"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(observer.stdout.take().unwrap()).lines();
    let mut next_leader = async || -> serde_json::Value {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the observer exited");
        serde_json::from_str(&line).unwrap()
    };
    assert!(next_leader().await["leader"].is_null());

    // A candidate that leads runs its command, with the term as its token.
    let fifo = |name: &str| {
        let path = dir.path().join(name);
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.unwrap().success());
        path
    };
    let leads = |value: &str, fifo: &std::path::Path| {
        let script = format!(
            "echo $$ $LEASEHOLD_TOKEN > {}; exec sleep 1000",
            fifo.display()
        );
        leasehold(&["elect", "sched", value, "--", "sh", "-c", &script])
            .spawn()
            .unwrap()
    };
    // The command's pid and its token, once it has started.
    let started = async |fifo: &std::path::Path| {
        let fifo = fifo.to_path_buf();
        let written = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
            .await
            .unwrap()
            .unwrap();
        let (pid, token) = written.trim().split_once(' ').unwrap();
        let pid = Pid::from_raw(pid.parse().unwrap()).unwrap();
        (pid, token.parse::<u64>().unwrap())
    };
    let (fifo_a, fifo_b) = (fifo("a"), fifo("b"));
    let mut a = leads("host-a", &fifo_a);
    let (command_a, term_a) = started(&fifo_a).await;
    let seen = next_leader().await;
    assert_eq!(seen["leader"]["value"], "host-a");
    assert_eq!(seen["leader"]["term"], term_a);

    // Another candidate waits; one that does not wait is told someone leads.
    let mut b = leads("host-b", &fifo_b);
    let out = leasehold(&["elect", "--no-wait", "sched", "host-c", "--", "true"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");

    // The leader's command ends: the waiting candidate leads, with a later term.
    kill_process(command_a, Signal::KILL).unwrap();
    assert_eq!(a.wait().await.unwrap().code(), Some(137));
    let (command_b, term_b) = started(&fifo_b).await;
    assert!(term_b > term_a);
    // The observer may or may not see the moment between the two.
    let mut seen = next_leader().await;
    if seen["leader"].is_null() {
        seen = next_leader().await;
    }
    assert_eq!(seen["leader"]["value"], "host-b");
    assert_eq!(seen["leader"]["term"], term_b);

    kill_process(command_b, Signal::KILL).unwrap();
    b.wait().await.unwrap();
    assert!(next_leader().await["leader"].is_null());
    let pid = Pid::from_raw(i32::try_from(observer.id().unwrap()).unwrap()).unwrap();
    kill_process(pid, Signal::INT).unwrap();
    assert_eq!(observer.wait().await.unwrap().code(), Some(130));
}

/// `leasehold release --force` on `url` evicts a `leasehold run` holder.
/// The holder's command is stopped (exit 80, saying who evicted it and why), the record is
/// shown by `inspect`, and a second eviction finds nobody (exit 75).
#[allow(dead_code, reason = "not every test file evicts")]
pub(crate) async fn a_forced_release_stops_the_holders_command_and_is_recorded(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let leasehold = |args: &[&str]| leasehold_on(url, args);
    let fifo = dir.path().join("ready");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let script = format!(
        "echo $LEASEHOLD_TOKEN > {}; exec sleep 1000",
        fifo.display()
    );
    let holder = leasehold(&["run", "--ttl", "3s", "stuck", "--", "sh", "-c", &script])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let token = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
        .await
        .unwrap()
        .unwrap();
    let token: u64 = token.trim().parse().unwrap();

    let out = leasehold(&[
        "release", "--force", "stuck", "--reason", "hung job", "--json",
    ])
    .output()
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["evicted"][0]["token"], token);
    assert_eq!(json["evicted"][0]["reason"], "hung job");

    // The holder finds out at its next renewal and stops its command.
    let out = holder.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(80), "{stderr}");
    assert!(
        stderr.contains("was evicted by") && stderr.contains("hung job"),
        "{stderr}"
    );

    let out = leasehold(&["inspect", "--json", "stuck"])
        .output()
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let record = &json["locks"][0]["evictions"][0];
    assert_eq!(record["token"], token);
    assert!(record["by"].as_str().unwrap().contains('@'), "{record}");
    let out = leasehold(&["release", "--force", "stuck", "--reason", "again"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(75));
}

/// The processes of process group `group` that are still running.
/// Zombies, which nobody may reap in a container whose init does not, are not running.
#[allow(dead_code, reason = "not every test file looks into process groups")]
pub(crate) fn running_in_group(group: Pid) -> Vec<i32> {
    let mut running = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Some(fields) = stat(pid) else {
            continue;
        };
        if fields.len() > 2
            && fields[2] == group.as_raw_nonzero().to_string()
            && !matches!(fields[0].as_str(), "Z" | "X")
        {
            running.push(pid);
        }
    }
    running
}

/// The fields of `/proc/<pid>/stat` after the command name (state, ppid, pgrp and so on).
fn stat(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid pgrp …; comm may hold anything, so split after its `)`.
    let (_, fields) = stat.rsplit_once(')')?;
    Some(fields.split_whitespace().map(str::to_owned).collect())
}

/// The lease of the paused run in [`a_paused_run_has_its_command_stopped_by_the_deadline`].
#[allow(dead_code, reason = "the file backend's tests have no lease to lose")]
pub(crate) const PAUSED_TTL: Duration = Duration::from_secs(2);

/// Runs `leasehold run --url url --ttl 2s --grace 1s`, frozen (SIGSTOP) while its command runs.
/// The command's supervisor, which is not frozen, stops the command's whole process group
/// by the lease's deadline while the run is still frozen; another client is then granted
/// the lock, with a larger token; and the run, resumed, exits 80. `url` must give the lock
/// a 2 s lease or session.
#[allow(dead_code, reason = "the file backend's tests have no lease to lose")]
pub(crate) async fn a_paused_run_has_its_command_stopped_by_the_deadline(url: &str) {
    // The command is its group's only process (`exec`).
    let script = r#"echo "$$ $LEASEHOLD_TOKEN"; exec sleep 60"#;
    let ttl = format!("{}ms", PAUSED_TTL.as_millis());
    let grace = format!("{}ms", (PAUSED_TTL / 2).as_millis());
    let mut paused = Command::new(BIN)
        .args([
            "run", "--url", url, "--ttl", &ttl, "--grace", &grace, "paused",
        ])
        .args(["--", "sh", "-c", script])
        .env_remove("LEASEHOLD_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(paused.stdout.take().unwrap()).lines();
    let started = lines
        .next_line()
        .await
        .unwrap()
        .expect("the command started");
    let (command, token) = started.split_once(' ').unwrap();
    let command = Pid::from_raw(command.parse().unwrap()).unwrap();
    let token: u64 = token.parse().unwrap();
    let run = Pid::from_raw(i32::try_from(paused.id().unwrap()).unwrap()).unwrap();

    // The run is frozen: it renews nothing. Its lease's deadline is at most one ttl away
    // (from its last renewal); ten leave room for a loaded machine.
    let pidfd = pidfd_open(command, PidfdFlags::empty()).unwrap();
    // SAFETY: the descriptor is open, owned by the `AsyncFd`, and its number never changes.
    #[allow(unsafe_code)]
    let exited = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }
    .unwrap();
    kill_process(run, Signal::STOP).unwrap();
    // A process's descriptor becomes readable when it has exited.
    let _ = tokio::time::timeout(10 * PAUSED_TTL, exited.readable())
        .await
        .expect("the command outlived the lease while `leasehold run` was frozen")
        .unwrap();
    assert_eq!(running_in_group(command), Vec::<i32>::new());
    assert_eq!(
        stat(run.as_raw_nonzero().get()).unwrap()[0],
        "T",
        "`leasehold run` is still stopped"
    );

    // The server gives the lock away.
    let other = leasehold::connect(url).await.unwrap();
    let next = other
        .mutex("paused")
        .unwrap()
        .lock_timeout(30 * PAUSED_TTL)
        .await
        .unwrap()
        .expect("the lock was given away");
    assert!(next.token().get() > token, "{} after {token}", next.token());

    // On resume the run notices that its lock is gone.
    kill_process(run, Signal::CONT).unwrap();
    let out = paused.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(80),
        "exit code of the resumed run: {stderr}"
    );
    assert!(stderr.contains("the lock on paused"), "{stderr}");
    assert!(
        test_kill_process_group(command).is_err(),
        "the command's process group outlived the lock"
    );
    next.release().await.unwrap();
}

/// Ten hosts fire the same job at every window of a 1 s period, each with its own clock.
/// That is an hourly job, time scaled down; each host runs under libfaketime with its own
/// wall clock: the clocks are spread over 0.9 s, nearly a whole window, far more skew for
/// the period than seconds are for an hour. Each host's `leasehold run --once-per 1s
/// --skew 480ms` starts when its own clock reaches the window's start, and the job is fast
/// (an `echo`): exactly the case where a plain lock runs a job twice. Over `windows` windows the job runs exactly once in each.
#[allow(dead_code, reason = "not every test file runs jobs")]
pub(crate) async fn ten_hosts_run_a_job_once_per_window(url: &str, windows: u64) {
    const PERIOD_MS: u64 = 1000;
    let library = leasehold_testkit::libfaketime().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("runs");
    let script = format!(
        r#"echo "$LEASEHOLD_WINDOW $LEASEHOLD_TOKEN" >> {}"#,
        log.display()
    );
    // Each host's clock is this many ms ahead of the real one (behind if negative).
    let offsets: Vec<i64> = (0..10).map(|host| -450 + 100 * host).collect();
    let now_ms = || {
        let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        i64::try_from(since.as_millis()).unwrap()
    };
    let period = i64::try_from(PERIOD_MS).unwrap();
    let first = (now_ms() / period + 2) * period;
    let boundaries: Vec<i64> = (0..i64::try_from(windows).unwrap())
        .map(|w| first + w * period)
        .collect();
    // A host fires when its clock reads the window's start: at start - offset, really.
    let mut fires: Vec<(i64, i64)> = (boundaries.iter())
        .flat_map(|b| offsets.iter().map(move |o| (b - o, *o)))
        .collect();
    fires.sort_unstable();
    let mut runs = tokio::task::JoinSet::new();
    for (at, offset) in fires {
        let wait = u64::try_from(at - now_ms()).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let mut command = leasehold_on(
            url,
            &[
                "run",
                "--once-per",
                "1s",
                "--skew",
                "480ms",
                "--ttl",
                "5s",
                "hourly",
                "--",
                "sh",
                "-c",
                &script,
            ],
        );
        command
            .env("LD_PRELOAD", &library)
            .env("FAKETIME", format!("{:+.3}", offset as f64 / 1000.0))
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        runs.spawn(async move { (offset, command.output().await.unwrap()) });
    }
    while let Some(joined) = runs.join_next().await {
        let (offset, out) = joined.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Ran (0), or found the window closed (79).
        assert!(
            matches!(out.status.code(), Some(0 | 79)),
            "host {offset:+} ms: {:?}: {stderr}",
            out.status
        );
    }
    let log = std::fs::read_to_string(&log).unwrap();
    let mut ran: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for line in log.lines() {
        let (window, token) = line.split_once(' ').unwrap();
        ran.entry(window.to_owned())
            .or_default()
            .push(token.parse().unwrap());
    }
    for b in &boundaries {
        let window = format!("{b}+{PERIOD_MS}");
        let tokens = ran.remove(&window).unwrap_or_default();
        assert_eq!(tokens.len(), 1, "window {window} ran {tokens:?} times");
    }
    // A host that read its clock late may have counted its fire for the next window; no
    // window ran twice all the same.
    assert!(ran.values().all(|t| t.len() == 1), "{ran:?}");
}

/// A job's run whose host freezes mid-run loses its lock and cannot close the window.
/// The next host runs the job in the same window with a higher token and closes it; the
/// frozen run, resumed, exits 80; a later host finds the window closed by the second run (79).
/// `url` must give the lock a [`PAUSED_TTL`] lease or session.
#[allow(dead_code, reason = "not every test file runs jobs")]
pub(crate) async fn a_frozen_jobs_window_goes_to_the_next_host(url: &str) {
    let ttl = format!("{}ms", PAUSED_TTL.as_millis());
    let grace = format!("{}ms", (PAUSED_TTL / 2).as_millis());
    let job = |script: &'static str| {
        let mut command = leasehold_on(
            url,
            &[
                "run",
                "--window-id",
                "2026-11-27T12:00",
                "--ttl",
                &ttl,
                "--grace",
                &grace,
                "frozen",
                "--",
                "sh",
                "-c",
                script,
            ],
        );
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        command
    };
    let mut frozen = job(r#"echo "$LEASEHOLD_TOKEN"; exec sleep 60"#)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(frozen.stdout.take().unwrap()).lines();
    let first: u64 = (lines.next_line().await.unwrap())
        .expect("the job started")
        .parse()
        .unwrap();
    let run = Pid::from_raw(i32::try_from(frozen.id().unwrap()).unwrap()).unwrap();
    kill_process(run, Signal::STOP).unwrap();

    // The next host waits for the lock, which the frozen run cannot renew, and runs.
    let out = job(r#"echo "$LEASEHOLD_TOKEN""#).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let second: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(second > first, "{second} after {first}");

    kill_process(run, Signal::CONT).unwrap();
    let out = frozen.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(80), "{stderr}");

    let out = job("echo ran").output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(79), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(stderr.contains(&format!("token {second}")), "{stderr}");
}

/// A job that fails closes its window, unless `--retry-failed` leaves it open.
/// The next run then retries it; `--at-most` stops a command that holds the lock too long.
#[allow(dead_code, reason = "not every test file runs jobs")]
pub(crate) async fn failed_jobs_close_their_window_unless_retried(url: &str) {
    let run = |window: &str, retry: bool, script: &str| {
        let mut args = vec!["run", "--window-id", window, "failing"];
        if retry {
            args.insert(1, "--retry-failed");
        }
        args.extend(["--", "sh", "-c", script]);
        let mut command = leasehold_on(url, &args);
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        async move { command.output().await.unwrap() }
    };
    let code = |out: &std::process::Output| out.status.code();
    assert_eq!(code(&run("closed", false, "exit 3").await), Some(3));
    let out = run("closed", false, "echo ran").await;
    assert_eq!(code(&out), Some(79));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("failed with exit code 3"), "{stderr}");

    assert_eq!(code(&run("open", true, "exit 3").await), Some(3));
    let out = run("open", true, "echo ran").await;
    assert_eq!(code(&out), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ran");
    assert_eq!(code(&run("open", true, "echo ran").await), Some(79));

    // --at-most: SIGTERM --grace before the limit; the command's code is its own.
    let out = leasehold_on(
        url,
        &[
            "run",
            "--at-most",
            "2s",
            "--grace",
            "1s",
            "capped",
            "--",
            "sleep",
            "60",
        ],
    )
    .stderr(Stdio::piped())
    .output()
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("--at-most"), "{stderr}");
}

/// `--at-least` leaves the lock held after the command ends.
/// It is held until that long after it started, even though `leasehold run` has exited:
/// another run finds it busy (75), then gets it. On a backend that cannot keep a grant, it is a usage error (64).
#[allow(dead_code, reason = "not every test file runs jobs")]
pub(crate) async fn at_least_holds_the_lock_after_the_command(url: &str, supported: bool) {
    let out = leasehold_on(url, &["run", "--at-least", "10s", "kept", "--", "true"])
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !supported {
        assert_eq!(out.status.code(), Some(64), "{stderr}");
        assert!(stderr.contains("--at-least"), "{stderr}");
        return;
    }
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let out = leasehold_on(url, &["run", "--no-wait", "kept", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "held after its holder exited");
    let out = leasehold_on(url, &["inspect", "--json", "kept"])
        .output()
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let holder = &json["locks"][0]["holders"][0];
    assert_eq!(holder["kept"], true, "{json}");
    let out = leasehold_on(url, &["run", "kept", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "free once the hold ended");
}

/// A scheduled job's `--at-least` counts from the run's start, once.
/// The job takes 5 s of an 8 s hold: the lock stays held about 3 s after it ends.
#[allow(dead_code, reason = "not every test file runs jobs")]
pub(crate) async fn a_jobs_at_least_counts_from_its_start(url: &str) {
    let out = leasehold_on(
        url,
        &[
            "run",
            "--window-id",
            "slow",
            "--at-least",
            "8s",
            "kept-job",
            "--",
            "sleep",
            "5",
        ],
    )
    .stderr(Stdio::piped())
    .output()
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let out = leasehold_on(url, &["run", "--no-wait", "kept-job", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "held after the job ended");
}

/// A tmux server of a test's own (its own socket), killed with everything in it when dropped.
#[allow(dead_code, reason = "not every test file opens a terminal")]
pub(crate) struct Terminal {
    socket: String,
}

#[allow(dead_code, reason = "not every test file opens a terminal")]
impl Terminal {
    /// A detached 240×50 session running `command`; its pane stays when the command exits.
    /// The pane is kept before the command starts, so a command that fails at once leaves
    /// its output to read.
    pub(crate) fn run(socket: &str, command: &str) -> Self {
        let terminal = Self {
            socket: socket.to_owned(),
        };
        let session = ["new-session", "-d", "-s", "w", "-x", "240", "-y", "50"];
        let keep = ["set-option", "-w", "-t", "w", "remain-on-exit", "on"];
        let start = ["respawn-pane", "-k", "-t", "w", command];
        terminal.tmux(&[&session[..], &[";"], &keep, &[";"], &start].concat());
        terminal
    }

    /// Runs a tmux command on this server; its output.
    pub(crate) fn tmux(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The screen as it shows now (text only; a line the terminal wrapped is one line).
    pub(crate) fn screen(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-J", "-t", "w"])
    }

    /// Waits until the screen shows what `want` accepts, and returns it.
    /// The terminal has no event to await; it is read again every 50 ms, for a minute at
    /// most.
    pub(crate) async fn until(&self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let screen = self.screen();
            if want(&screen) {
                return screen;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the terminal never showed {what}; it shows:\n{screen}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .output();
    }
}

/// `leasehold locks --watch` on `url`, in a real terminal (tmux), while a lock changes hands.
/// The screen shows the first holder with its token, the hand-off to a waiting second
/// holder with the later token, then the lock freed.
#[allow(dead_code, reason = "not every test file watches")]
pub(crate) async fn a_terminal_watch_shows_a_lock_change_hands(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let terminal = Terminal::run(
        &socket,
        &format!("exec {BIN} locks --watch --url '{url}' --prefix watched:"),
    );
    let fifo = |name: &str| {
        let path = dir.path().join(name);
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.unwrap().success());
        path
    };
    let hold = |fifo: &std::path::Path| {
        let script = format!(
            "echo $$ $LEASEHOLD_TOKEN > {}; exec sleep 1000",
            fifo.display()
        );
        leasehold_on(url, &["run", "watched:a", "--", "sh", "-c", &script])
            .spawn()
            .unwrap()
    };
    // A holder's command has started: its pid and token. A run that fails before its
    // command starts would leave the read waiting: a minute at most.
    let started = async |fifo: &std::path::Path| {
        let fifo = fifo.to_path_buf();
        let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo));
        let written = tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .expect("the holder's command never started")
            .unwrap()
            .unwrap();
        let (pid, token) = written.trim().split_once(' ').unwrap();
        (
            Pid::from_raw(pid.parse().unwrap()).unwrap(),
            token.to_owned(),
        )
    };
    // A line of the screen about watched:a that has all of `words`.
    let line_with = |screen: &str, words: &[&str]| {
        screen
            .lines()
            .any(|line| line.contains("watched:a") && words.iter().all(|w| line.contains(w)))
    };

    let (fifo_a, fifo_b) = (fifo("a"), fifo("b"));
    let mut a = hold(&fifo_a);
    let (command_a, token_a) = started(&fifo_a).await;
    let token = format!("token {token_a} ");
    terminal
        .until("the first holder", |s| {
            line_with(s, &["holder", &format!(" {token_a} ")]) && line_with(s, &[&token])
        })
        .await;

    let mut b = hold(&fifo_b);
    kill_process(command_a, Signal::KILL).unwrap();
    a.wait().await.unwrap();
    let (command_b, token_b) = started(&fifo_b).await;
    assert!(token_b.parse::<u64>().unwrap() > token_a.parse::<u64>().unwrap());
    let token = format!("token {token_b} ");
    let screen = terminal
        .until("the hand-off", |s| {
            line_with(s, &["holder", &format!(" {token_b} ")])
                && (line_with(s, &["handoff", &token]) || line_with(s, &["granted", &token]))
        })
        .await;
    assert!(
        line_with(&screen, &["handoff", &token]) || line_with(&screen, &["freed", &token_a]),
        "the first holder's end is shown:\n{screen}"
    );

    kill_process(command_b, Signal::KILL).unwrap();
    b.wait().await.unwrap();
    terminal
        .until("the lock freed", |s| {
            line_with(s, &["free "]) && line_with(s, &["freed", &token])
        })
        .await;

    // (Ctrl-C sent to the pane did not always reach the watch: twice the pane showed ^C
    // and the process slept on, and a process that then ended stayed unreaped — tmux, not
    // the watch, by every sign. The exit on SIGINT is tested without a terminal:
    // `a_watch_prints_json_lines_and_ends_with_130_on_sigint`.)
}
