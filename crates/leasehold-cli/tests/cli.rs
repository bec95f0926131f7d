//! The `leasehold` binary end to end, on the local file backend.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use leasehold::Backend;
use rustix::process::{Pid, Signal, kill_process, kill_process_group, test_kill_process};
use tokio::process::Command;

mod common;
use common::{BIN, running_in_group};

struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn url(&self) -> String {
        format!("file://{}", self.path("locks").display())
    }

    /// `leasehold ARGS` with LEASEHOLD_URL pointing at this directory's locks.
    fn leasehold(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("LEASEHOLD_URL", self.url())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    }

    async fn output(&self, args: &[&str]) -> Output {
        self.leasehold(args).output().await.unwrap()
    }

    /// A FIFO the command writes its pid into.
    fn fifo(&self, name: &str) -> PathBuf {
        let path = self.path(name);
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        path
    }
}

/// Waits until the command has written into `fifo`, and returns what it wrote.
async fn read_fifo(fifo: &Path) -> String {
    let fifo = fifo.to_path_buf();
    tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
        .await
        .unwrap()
        .unwrap()
}

async fn read_pid(fifo: &Path) -> Pid {
    Pid::from_raw(read_fifo(fifo).await.trim().parse().unwrap()).unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn runs_a_command_under_the_lock() {
    let d = Dir::new();
    let out = d.output(&["run", "demo", "--", "echo", "hello"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello\n");
}

/// `run --events FILE` appends one JSON line per grant and release.
/// Each names the holder and its token; a second run appends to the same file.
#[tokio::test]
async fn run_records_its_grant_and_release_as_json_lines() {
    let d = Dir::new();
    let events = d.path("events.jsonl");
    let events_arg = events.to_str().unwrap();
    for _ in 0..2 {
        let out = d
            .output(&[
                "run",
                "--events",
                events_arg,
                "audited",
                "--",
                "sh",
                "-c",
                "echo $LEASEHOLD_TOKEN",
            ])
            .await;
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    let written = std::fs::read_to_string(&events).unwrap();
    let lines: Vec<serde_json::Value> = written
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let kinds: Vec<&str> = lines.iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["granted", "released", "granted", "released"],
        "{written}"
    );
    for line in &lines {
        assert_eq!(line["name"], "audited");
        assert_eq!(line["backend"], "file");
        assert!(line["at_ms"].as_u64().unwrap() > 0);
    }
    assert_eq!(lines[0]["owner"], lines[1]["owner"]);
    assert_eq!(lines[0]["token"], lines[1]["token"]);
    assert!(lines[0]["sent_ms"].as_u64().unwrap() <= lines[0]["at_ms"].as_u64().unwrap());
    assert_ne!(lines[0]["owner"], lines[2]["owner"]);

    let unwritable = d
        .output(&[
            "run",
            "--events",
            "/nonexistent/dir/e.jsonl",
            "x",
            "--",
            "true",
        ])
        .await;
    assert_eq!(
        unwritable.status.code(),
        Some(64),
        "{}",
        text(&unwritable.stderr)
    );
}

#[tokio::test]
async fn twenty_processes_count_exactly_and_see_increasing_tokens() {
    let d = Dir::new();
    common::twenty_runs_share_a_counter(&d.url()).await;
}

#[tokio::test]
async fn exit_codes_for_busy_and_bad_usage() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    let script = format!("echo $$ > {}; exec sleep 1000", fifo.display());
    let mut holder = d
        .leasehold(&["run", "busy", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&fifo).await;

    let out = d.output(&["run", "--no-wait", "busy", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    let out = d
        .output(&["run", "--wait", "200ms", "busy", "--", "true"])
        .await;
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));

    for bad in [
        &["run", "--ttl", "10", "x", "--", "true"][..],
        &["run", "bad name", "--", "true"],
        &["run", "x"],
        &["run", "--permits", "0", "x", "--", "true"],
        &["run", "--shared", "--permits", "2", "x", "--", "true"],
        &[
            "run",
            "--url",
            "nosuch://user:hunter2@host",
            "x",
            "--",
            "true",
        ],
        &["frobnicate"],
    ] {
        let out = d.output(bad).await;
        assert_eq!(
            out.status.code(),
            Some(64),
            "{bad:?}: {}",
            text(&out.stderr)
        );
        assert!(
            !text(&out.stderr).contains("hunter2"),
            "a password in {bad:?}"
        );
    }
    let out = d.output(&["--help"]).await;
    assert_eq!(out.status.code(), Some(0));

    let _ = kill_process(command, Signal::KILL);
    holder.kill().await.unwrap();
}

#[tokio::test]
async fn a_grace_that_does_not_fit_in_the_lease_is_a_usage_error() {
    let d = Dir::new();
    // SIGTERM goes `--grace` before the deadline of a 2 s lease, whose first renewal is
    // due after 667 ms: a grace of 2 s or more cannot fit, nor one that leaves no time
    // for that renewal.
    for grace in ["2s", "5s", "1500ms"] {
        let out = d
            .output(&[
                "run", "--url", "memory:", "--ttl", "2s", "--grace", grace, "x", "--", "true",
            ])
            .await;
        assert_eq!(
            out.status.code(),
            Some(64),
            "{grace}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains("--grace"),
            "{}",
            text(&out.stderr)
        );
    }
    // One that fits, and the default (a third of a ttl under 30 s).
    for grace in [&["--grace", "1s"][..], &[]] {
        let out = d
            .leasehold(&["run", "--url", "memory:", "--ttl", "2s"])
            .args(grace)
            .args(["x", "--", "true"])
            .output()
            .await
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{grace:?}: {}",
            text(&out.stderr)
        );
    }
    // Locks that do not expire (the file backend) have no deadline to fit into.
    let out = d
        .output(&["run", "--ttl", "2s", "--grace", "600s", "x", "--", "true"])
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// `run a b c` takes every lock or none, and gives the command each one's token.
#[tokio::test]
async fn several_names_are_taken_all_or_none_with_a_token_each() {
    let d = Dir::new();
    let fifo = d.fifo("busy");
    let script = format!("echo $$ > {}; exec sleep 1000", fifo.display());
    let mut holder = d
        .leasehold(&["run", "ledger-b", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&fifo).await;
    let out = d
        .output(&[
            "run",
            "--no-wait",
            "ledger-a",
            "ledger-b",
            "ledger-c",
            "--",
            "true",
        ])
        .await;
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    let out = d
        .output(&["run", "--no-wait", "ledger-a", "ledger-c", "--", "true"])
        .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "a part was left held: {}",
        text(&out.stderr)
    );
    kill_process(command, Signal::KILL).unwrap();
    holder.wait().await.unwrap();

    let fifo = d.fifo("all");
    let script = format!(
        "echo \"$$|$LEASEHOLD_LOCK|$LEASEHOLD_TOKEN\" > {}; exec sleep 1000",
        fifo.display()
    );
    let names = ["ledger-c", "ledger-a", "ledger-b"];
    let mut args = vec!["run"];
    args.extend(names);
    args.extend(["--", "sh", "-c", &script]);
    let mut holder = d.leasehold(&args).spawn().unwrap();
    let written = read_fifo(&fifo).await;
    let mut fields = written.trim().split('|');
    let (pid, locks, tokens) = (
        fields.next().unwrap(),
        fields.next().unwrap(),
        fields.next().unwrap(),
    );
    assert_eq!(locks, names.join(" "));
    let tokens: Vec<u64> = tokens.split(' ').map(|t| t.parse().unwrap()).collect();
    let out = d
        .output(&[&["inspect", "--json"][..], &names].concat())
        .await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for (i, lock) in json["locks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(lock["name"], names[i]);
        assert_eq!(lock["holders"][0]["token"], tokens[i], "{lock}");
    }
    let out = d
        .output(&["run", "--no-wait", "ledger-a", "--", "true"])
        .await;
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    let out = d
        .output(&[
            "run",
            "--permits",
            "2",
            "ledger-d",
            "ledger-e",
            "--",
            "true",
        ])
        .await;
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
    let command = Pid::from_raw(pid.parse().unwrap()).unwrap();
    kill_process(command, Signal::KILL).unwrap();
    holder.wait().await.unwrap();
}

#[tokio::test]
async fn inspect_shows_the_holder_as_json_and_as_a_table() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    let script = format!(
        "echo $$ $LEASEHOLD_TOKEN > {}; exec sleep 1000",
        fifo.display()
    );
    let mut holder = d
        .leasehold(&["run", "report", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let written = read_fifo(&fifo).await;
    let (pid, token) = written.trim().split_once(' ').unwrap();
    let command = Pid::from_raw(pid.parse().unwrap()).unwrap();
    let token: u64 = token.parse().unwrap();

    let out = d.output(&["inspect", "--json", "report", "idle"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = json["locks"].as_array().unwrap();
    assert_eq!(locks[0]["name"], "report");
    assert_eq!(locks[0]["holders"][0]["token"], token);
    assert_eq!(locks[0]["holders"][0]["mode"], "exclusive");
    assert!(locks[1]["holders"].as_array().unwrap().is_empty());

    let out = d.output(&["inspect", "report"]).await;
    let table = text(&out.stdout);
    assert!(table.lines().next().unwrap().starts_with("LOCK"));
    assert!(
        table.contains(&format!("report  holder  exclusive  {token}")),
        "{table}"
    );

    let out = d.output(&["inspect", "--json", "bad name"]).await;
    assert_eq!(out.status.code(), Some(64));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["error"]["kind"], "invalid_argument");

    kill_process(command, Signal::KILL).unwrap();
    holder.wait().await.unwrap();
}

#[tokio::test]
async fn locks_lists_every_held_lock_without_its_name() {
    let d = Dir::new();
    let mut holders = Vec::new();
    let mut tokens = Vec::new();
    for name in ["jobs:a", "jobs:b", "other"] {
        let fifo = d.fifo(&format!("ready-{name}"));
        let script = format!(
            "echo $$ $LEASEHOLD_TOKEN > {}; exec sleep 1000",
            fifo.display()
        );
        let holder = d
            .leasehold(&["run", name, "--", "sh", "-c", &script])
            .spawn()
            .unwrap();
        let written = read_fifo(&fifo).await;
        let (pid, token) = written.trim().split_once(' ').unwrap();
        holders.push((holder, Pid::from_raw(pid.parse().unwrap()).unwrap()));
        tokens.push(token.parse::<u64>().unwrap());
    }

    let out = d.output(&["locks", "--prefix", "jobs:", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = json["locks"].as_array().unwrap();
    let names: Vec<&str> = locks.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["jobs:a", "jobs:b"]);
    for (lock, token) in locks.iter().zip(&tokens) {
        let holder = &lock["holders"][0];
        assert_eq!(holder["token"], *token);
        assert!(holder["held_ms"].is_u64(), "{holder}");
    }

    // Every lock, as a table (not a terminal: no colour).
    let out = d.output(&["locks"]).await;
    let table = text(&out.stdout);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "LOCK", "ROLE", "MODE", "TOKEN", "HELD", "TTL", "OWNER", "VALUE"
        ]
    );
    assert_eq!(table.lines().count(), 4, "{table}");
    assert!(!table.contains('\x1b'), "{table}");

    // Held for less than an hour: none is older.
    let out = d.output(&["locks", "--older-than", "1h", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["locks"].as_array().unwrap().len(), 0, "{json}");
    let out = d.output(&["locks", "--older-than", "0s", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["locks"].as_array().unwrap().len(), 3, "{json}");

    let out = d.output(&["locks", "--prefix", "jobs*", "--json"]).await;
    assert_eq!(out.status.code(), Some(64));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["error"]["kind"], "invalid_argument");

    for (mut holder, command) in holders {
        kill_process(command, Signal::KILL).unwrap();
        holder.wait().await.unwrap();
    }
    let out = d.output(&["locks", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["locks"].as_array().unwrap().len(), 0, "{json}");
}

#[tokio::test]
async fn a_terminal_watch_shows_a_lock_change_hands() {
    let d = Dir::new();
    common::a_terminal_watch_shows_a_lock_change_hands(&d.url()).await;
}

/// `locks --watch --json` prints one object per change as it happens.
/// It ends with 130 on SIGINT.
#[tokio::test]
async fn a_watch_prints_json_lines_and_ends_with_130_on_sigint() {
    use tokio::io::AsyncBufReadExt as _;
    let d = Dir::new();
    let mut watch = d
        .leasehold(&["locks", "--watch", "--json", "--prefix", "w:"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    // Taken and released again and again until the watch has shown a grant (it may have
    // started after the first ones).
    let seen = async {
        loop {
            let out = d.output(&["run", "w:job", "--", "true"]).await;
            assert_eq!(out.status.code(), Some(0));
            let line = tokio::time::timeout(Duration::from_millis(500), lines.next_line()).await;
            if let Ok(line) = line {
                return line.unwrap().expect("the watch ended");
            }
        }
    };
    let line = tokio::time::timeout(Duration::from_secs(60), seen)
        .await
        .unwrap();
    let change: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(change["name"], "w:job");
    let pid = Pid::from_raw(i32::try_from(watch.id().unwrap()).unwrap()).unwrap();
    kill_process(pid, Signal::INT).unwrap();
    assert_eq!(watch.wait().await.unwrap().code(), Some(130));
}

#[tokio::test]
async fn elect_hands_on_leadership_and_observers_see_each_leader() {
    let d = Dir::new();
    common::elect_hands_on_leadership_and_observers_see_each_leader(&d.url()).await;
    // Bad usage: no value, or a value and --observe.
    for bad in [
        &["elect", "sched", "--", "true"][..],
        &["elect", "--observe", "sched", "v"],
    ] {
        let out = d.output(bad).await;
        assert_eq!(out.status.code(), Some(64), "{bad:?}");
    }
}

#[tokio::test]
async fn a_forced_release_is_refused_where_the_kernel_holds_the_lock() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    let script = format!("echo $$ > {}; exec sleep 1000", fifo.display());
    let mut holder = d
        .leasehold(&["run", "job", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&fifo).await;
    // A file lock belongs to its process: only stopping that process frees it.
    let out = d
        .output(&["release", "--force", "job", "--reason", "stuck"])
        .await;
    assert_eq!(out.status.code(), Some(64));
    assert!(
        text(&out.stderr).contains("force-release is not supported by the file backend"),
        "{}",
        text(&out.stderr)
    );
    // Without --force or --reason there is nothing to do.
    for bad in [&["release", "job"][..], &["release", "--force", "job"]] {
        assert_eq!(d.output(bad).await.status.code(), Some(64), "{bad:?}");
    }
    kill_process(command, Signal::KILL).unwrap();
    holder.wait().await.unwrap();
}

#[tokio::test]
async fn a_holder_killed_with_sigkill_frees_the_lock_once_its_command_is_gone() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    let script = format!("echo $$ > {}; exec sleep 1000", fifo.display());
    let mut holder = d
        .leasehold(&["run", "job", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&fifo).await;
    holder.start_kill().unwrap();
    holder.wait().await.unwrap();
    // The next run gets the lock (waiting for it while the orphaned command is stopped)…
    let out = d.output(&["run", "job", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // …and the command did not outlive its lock.
    assert_eq!(running_in_group(command), Vec::<i32>::new());
}

#[tokio::test]
async fn sigkill_of_leasehold_stops_the_commands_whole_group() {
    let d = Dir::new();
    for url in [d.url(), "memory:".to_owned()] {
        let fifo = d.fifo(&format!("ready-{}", url.len()));
        // The command leads its group and leaves a child in it.
        let script = format!("sleep 1000 & echo $$ > {}; wait", fifo.display());
        let mut holder = Command::new(BIN)
            .args([
                "run", "--url", &url, "--ttl", "1h", "--grace", "600s", "job",
            ])
            .args(["--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let group = read_pid(&fifo).await;
        assert_eq!(running_in_group(group).len(), 2, "{url}");
        let mut stdout = holder.stdout.take().unwrap();
        holder.start_kill().unwrap();
        holder.wait().await.unwrap();
        // Every process of the group shares this stdout: it ends when the last is gone.
        let mut rest = Vec::new();
        tokio::time::timeout(
            Duration::from_secs(60),
            tokio::io::AsyncReadExt::read_to_end(&mut stdout, &mut rest),
        )
        .await
        .unwrap_or_else(|_| panic!("{url}: the command's group outlived leasehold"))
        .unwrap();
        assert_eq!(running_in_group(group), Vec::<i32>::new(), "{url}");
    }
}

#[tokio::test]
async fn on_the_file_backend_no_second_run_starts_while_a_process_of_the_first_lives() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    // The command and its child ignore SIGTERM: after leasehold is killed they live on for
    // the grace period, holding the lock.
    let script = format!(
        "trap '' TERM; sleep 1000 & echo $$ > {}; wait",
        fifo.display()
    );
    let mut first = d
        .leasehold(&["run", "--grace", "600s", "job", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let group = read_pid(&fifo).await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let out = d.output(&["run", "--no-wait", "job", "--", "true"]).await;
    assert_eq!(
        out.status.code(),
        Some(75),
        "a second run started beside the first one's command: {}",
        text(&out.stderr)
    );
    // It was refused while the first command still ran.
    assert!(!running_in_group(group).is_empty());
    // Once the whole group is gone, the lock is free.
    let second = d
        .leasehold(&["run", "job", "--", "echo", "second"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    kill_process_group(group, Signal::KILL).unwrap();
    let out = second.wait_with_output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "second\n");
}

#[tokio::test]
async fn sigterm_to_leasehold_stops_the_command_and_releases() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    let script = format!("echo $$ > {}; exec sleep 1000", fifo.display());
    let holder = d
        .leasehold(&["run", "--grace", "2s", "job", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let leasehold = Pid::from_raw(holder.id().unwrap() as i32).unwrap();
    let command = read_pid(&fifo).await;
    kill_process(leasehold, Signal::TERM).unwrap();
    let out = holder.wait_with_output().await.unwrap();
    assert_eq!(out.status.code(), Some(143));
    assert_eq!(test_kill_process(command), Err(rustix::io::Errno::SRCH));
    let out = d.output(&["run", "--no-wait", "job", "--", "true"]).await;
    assert_eq!(out.status.code(), Some(0));
}

#[tokio::test]
async fn sigint_while_waiting_exits_130_without_running_the_command() {
    let d = Dir::new();
    let fifo = d.fifo("ready");
    let script = format!("echo $$ > {}; exec sleep 1000", fifo.display());
    let mut holder = d
        .leasehold(&["run", "job", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&fifo).await;
    let marker = d.path("ran");
    let waiter = d
        .leasehold(&["run", "job", "--", "touch", marker.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let waiter_pid = Pid::from_raw(waiter.id().unwrap() as i32).unwrap();
    // Wait until it is queued: its waiter record appears, which the lock directory's
    // change notification reports.
    let locks = leasehold::file::FileBackend::open(d.path("locks")).unwrap();
    let name = leasehold::LockName::new("job").unwrap();
    loop {
        let state = locks.inspect(&name).await.unwrap();
        if !state.waiters.is_empty() {
            break;
        }
        locks
            .wait(&name, &state.hint, Duration::from_secs(5))
            .await
            .unwrap();
    }
    kill_process(waiter_pid, Signal::INT).unwrap();
    let out = waiter.wait_with_output().await.unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    assert!(!marker.exists());
    let out = d.output(&["inspect", "--json", "job"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["locks"][0]["waiters"].as_array().unwrap().is_empty());
    kill_process(command, Signal::KILL).unwrap();
    holder.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_hosts_with_skewed_clocks_run_a_job_once_per_window() {
    let d = Dir::new();
    common::ten_hosts_run_a_job_once_per_window(&d.url(), 30).await;
}

#[tokio::test]
async fn failed_jobs_close_their_window_unless_retried() {
    let d = Dir::new();
    common::failed_jobs_close_their_window_unless_retried(&d.url()).await;
    // The kernel's locks end with their holder: none outlives it.
    common::at_least_holds_the_lock_after_the_command(&d.url(), false).await;
}

/// `audit --follow DIR` reports a double grant as the hosts' files grow.
/// It serves its counters for Prometheus, and when stopped prints its summary and exits 1.
/// The two hosts lock one name in two lock directories: a split brain, on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_follow_reports_a_split_brain_as_it_happens_and_serves_counters() {
    use tokio::io::AsyncBufReadExt as _;
    let d = Dir::new();
    let events = d.path("events");
    std::fs::create_dir(&events).unwrap();
    let port = leasehold_testkit::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut auditor = d
        .leasehold(&[
            "audit",
            "--follow",
            "--json",
            "--clock-uncertainty",
            "5ms",
            "--metrics-listen",
            &listen,
            events.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let host = |name: &str| {
        let url = format!("file://{}", d.path(&format!("locks-{name}")).display());
        let file = events.join(format!("{name}.jsonl"));
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--url", &url, "--events", file.to_str().unwrap()])
            .args(["nightly", "--", "sleep", "0.5"])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        async move { cmd.output().await.unwrap() }
    };
    let (x, y) = tokio::join!(host("x"), host("y"));
    assert_eq!(x.status.code(), Some(0), "{}", text(&x.stderr));
    assert_eq!(y.status.code(), Some(0), "{}", text(&y.stderr));

    // The finding comes while the auditor still runs.
    let mut lines = tokio::io::BufReader::new(auditor.stdout.take().unwrap()).lines();
    let finding: serde_json::Value = tokio::time::timeout(Duration::from_secs(60), async {
        let line = lines.next_line().await.unwrap().unwrap();
        serde_json::from_str(&line).unwrap()
    })
    .await
    .expect("no finding from audit --follow");
    assert_eq!(finding["check"], "double_grant", "{finding}");
    assert_eq!(finding["subject"], "nightly");
    let detail = finding["detail"].as_str().unwrap();
    assert!(
        detail.contains("x token") && detail.contains("y token"),
        "{detail}"
    );

    let scraped = leasehold_testkit::scrape_metrics(port).await;
    let series = |prefix: &str| {
        scraped
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(
        series(r#"leasehold_audit_findings_total{check="double_grant"}"#),
        Some(1.0),
        "{scraped}"
    );
    assert_eq!(
        series(r#"leasehold_audit_events_total{kind="granted"}"#),
        Some(2.0),
        "{scraped}"
    );
    assert!(series("leasehold_audit_overlap_milliseconds_total").unwrap() > 0.0);

    let pid = Pid::from_raw(i32::try_from(auditor.id().unwrap()).unwrap()).unwrap();
    kill_process(pid, Signal::TERM).unwrap();
    let out = auditor.wait_with_output().await.unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let summary = text(&out.stderr);
    assert!(
        summary.contains("2 hosts") && summary.contains("double_grant"),
        "{summary}"
    );
}
