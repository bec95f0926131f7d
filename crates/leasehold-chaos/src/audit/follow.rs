//! `leasehold audit --follow`: the auditor on files that are still being written.
//!
//! Each file is read from where the last read stopped, complete lines only; the kernel says
//! when one grows (inotify on their directories), so nothing is polled on Linux. A file
//! replaced by a copy of itself (a new inode that starts with the same bytes, as a shipper's
//! write-and-rename makes) is read on from where it was; one cut shorter (truncated) or
//! starting differently is a new record, read from its start. A backlog is read in pieces,
//! the watermark moving between them. With a state file, the auditor's state and each
//! file's position are saved together (written to a temporary file and renamed over, so a
//! crash leaves the old or the new one, whole) every few seconds, as soon as a finding is
//! made, and on the way out; a restart loads them and goes on where it stopped. A finding
//! is reported at least once: only a crash between reporting it and the save repeats it.

use std::future::Future;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::listen::{Incoming, Streams};
use super::{Audit, Auditor, Finding, Spec, host_of};

/// Where the reading of one file stands.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Tail {
    path: PathBuf,
    /// Its host, an index into the auditor's hosts.
    host: usize,
    offset: u64,
    inode: u64,
    /// The file's first bytes (up to [`HEAD`]) as read.
    /// A file replaced by a copy of itself (a shipper's write-and-rename) starts with them,
    /// a new record does not.
    #[serde(default)]
    head: Vec<u8>,
}

/// How many of a file's first bytes tell it apart from another.
const HEAD: usize = 256;
/// The most read from one file in one round.
/// A backlog is read in pieces, the auditor moving its watermark (and freeing what it
/// kept) between them.
const CHUNK: u64 = 4 << 20;
/// How often the state is saved, at most (and as soon as a finding is made).
const SAVE_EVERY: Duration = Duration::from_secs(5);

/// What a restart resumes from.
#[derive(Debug, Deserialize)]
struct Saved {
    roots: Vec<PathBuf>,
    auditor: Auditor,
    tails: Vec<Tail>,
}

/// What is saved: [`Saved`], borrowed.
#[derive(Debug, Serialize)]
struct Saving<'a> {
    roots: &'a [PathBuf],
    auditor: &'a Auditor,
    tails: &'a [Tail],
}

/// Follows `spec.files` until `stop` completes, and returns the report.
/// It calls `on_finding` for each finding as it is made; the report's findings are this
/// run's.
///
/// A directory among `spec.files` stands for every `*.jsonl` file in it, those created
/// later included: each is a host of its own (a new process, a restarted one). With
/// `spec.listen`, hosts may also stream their events to it ([`super::listen`]).
///
/// On `stop`, with a state file the state is saved for the next run to resume from; without
/// one the record is taken as complete, and holds still open end at their promises (as
/// [`super::audit`] ends them).
///
/// # Errors
///
/// A state file that cannot be read or written, or a directory that cannot be watched.
///
/// # Cancel safety
///
/// Dropping the future loses what was read since the last save; a restart reads it again.
pub async fn follow(
    spec: &Spec,
    stop: impl Future<Output = ()>,
    mut on_finding: impl FnMut(&Finding),
) -> Result<Audit, String> {
    let (mut auditor, mut tails) = match &spec.state {
        Some(path) if path.exists() => resume(path, spec)?,
        _ => {
            let files: Vec<PathBuf> = spec.files.iter().filter(|p| !p.is_dir()).cloned().collect();
            let tails = (0..files.len())
                .map(|host| Tail {
                    path: files[host].clone(),
                    host,
                    ..Tail::default()
                })
                .collect();
            // Each file counts as heard from now, as one found later does when added.
            let mut auditor = spec.auditor_of(&files);
            auditor.heard_all_at(Instant::now());
            (auditor, tails)
        }
    };
    let mut changes = Changes::watch(&spec.files)?;
    let mut streams = match spec.listen {
        Some(address) => Some(Streams::bind(address).await?),
        None => None,
    };
    let mut stop = pin!(stop);
    let mut found = Vec::new();
    let mut kept_at_most = 0;
    let mut saved_at = Instant::now();
    let mut counted_at = Instant::now();
    let mut written = 0;
    let mut stopping = false;
    loop {
        discover(&spec.files, &mut tails, &mut auditor);
        if let Some(streams) = &mut streams {
            streams.drain(&mut auditor);
        }
        let mut more = false;
        for tail in &mut tails {
            let host = tail.host;
            more |= read_new(tail, |read| match read {
                Some(line) => auditor.line(host, line),
                // What was written before and not read yet is elsewhere or gone.
                None => auditor.reconnected(host),
            });
        }
        if stopping && spec.state.is_none() {
            auditor.finish();
        } else {
            auditor.advance();
        }
        let new = auditor.take_findings();
        for finding in &new {
            on_finding(finding);
        }
        if let Some(path) = &spec.state
            && (stopping || !new.is_empty() || saved_at.elapsed() >= SAVE_EVERY)
        {
            save(path, &spec.files, &auditor, &tails)?;
            saved_at = Instant::now();
        }
        // Counted now and then: it walks every name kept.
        if stopping || counted_at.elapsed() >= SAVE_EVERY {
            kept_at_most = kept_at_most.max(auditor.kept());
            counted_at = Instant::now();
        }
        let drawn = auditor.timelines().0.len();
        if let Some(path) = &spec.html
            && (stopping || drawn > written)
        {
            write_page(path, &auditor)?;
            written = drawn;
        }
        found.extend(new);
        if stopping {
            break;
        }
        // One more round after the stop: what was written up to it is read.
        if more {
            // A backlog: read on once the runtime has had a turn (signals, streams, the
            // metrics endpoint), unless told to stop.
            tokio::task::yield_now().await;
            tokio::select! {
                biased;
                () = &mut stop => stopping = true,
                () = std::future::ready(()) => {}
            }
            continue;
        }
        tokio::select! {
            () = &mut stop => stopping = true,
            () = changes.next() => {}
            Some(incoming) = next_line(&mut streams) => {
                if let Some(streams) = &mut streams {
                    streams.feed(incoming, &mut auditor);
                }
            }
        }
    }
    Ok(Audit::of(&auditor, found, kept_at_most))
}

/// The next line of a stream, if the auditor listens; else never.
async fn next_line(streams: &mut Option<Streams>) -> Option<Incoming> {
    match streams {
        Some(streams) => streams.next().await,
        None => std::future::pending().await,
    }
}

/// Adds a host for each `*.jsonl` file that appeared in a directory of `roots`.
fn discover(roots: &[PathBuf], tails: &mut Vec<Tail>, auditor: &mut Auditor) {
    for dir in roots.iter().filter(|p| p.is_dir()) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut new: Vec<PathBuf> = entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
            .filter(|p| !tails.iter().any(|t| &t.path == p))
            .collect();
        new.sort();
        for path in new {
            let host = auditor.add_host(host_of(&path));
            tails.push(Tail {
                path,
                host,
                ..Tail::default()
            });
        }
    }
}

/// The state saved at `path`, if it is for `spec.files`.
fn resume(path: &Path, spec: &Spec) -> Result<(Auditor, Vec<Tail>), String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let saved: Saved = serde_json::from_slice(&text)
        .map_err(|e| format!("{}: not a saved audit state: {e}", path.display()))?;
    if saved.roots != spec.files {
        return Err(format!(
            "{}: saved for other files ({}); give the same files in the same order, or \
             another state file",
            path.display(),
            saved
                .roots
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut auditor = saved.auditor;
    auditor.heard_all_at(Instant::now());
    if let Some(window) = spec.timeline_ms {
        // What happened before the restart is not kept: its first timelines start there.
        auditor = auditor.with_timelines(window);
    }
    Ok((auditor, saved.tails))
}

/// Writes the page of the timelines drawn so far to `path`, through a temporary file.
fn write_page(path: &Path, auditor: &Auditor) -> Result<(), String> {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, super::page(auditor))
        .and_then(|()| std::fs::rename(&temporary, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Writes the state to `path` through a temporary file renamed over it.
fn save(path: &Path, roots: &[PathBuf], auditor: &Auditor, tails: &[Tail]) -> Result<(), String> {
    let saving = Saving {
        roots,
        auditor,
        tails,
    };
    let text = serde_json::to_vec(&saving).map_err(|e| e.to_string())?;
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text)
        .and_then(|()| std::fs::rename(&temporary, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Feeds `tail`'s complete new lines (at most [`CHUNK`] bytes of them) to `line`.
/// It moves the position past them, and returns whether more is there to read. A record
/// that starts over (replaced by another, or cut and written again) is told first as
/// `None`: lines not read yet may have gone with the old one. A file not there yet is read
/// when it appears.
fn read_new(tail: &mut Tail, mut line: impl FnMut(Option<&str>)) -> bool {
    let Ok(mut file) = std::fs::File::open(&tail.path) else {
        return false;
    };
    let Ok(meta) = file.metadata() else {
        return false;
    };
    let mut head = Vec::with_capacity(HEAD);
    if (&mut file)
        .take(HEAD as u64)
        .read_to_end(&mut head)
        .is_err()
    {
        return false;
    }
    let same_start = head.starts_with(&tail.head) || tail.head.starts_with(&head);
    if !same_start {
        // Another record (replaced, or cut and written again): from its start.
        tail.offset = 0;
        tail.head.clear();
        line(None);
    } else if meta.len() < tail.offset {
        // Shorter, with the same start: cut (and being written again), or being copied
        // over in place. Wait: a new record shows by its start.
        return false;
    }
    // A new inode with the same start and at least as long: the same record, copied.
    tail.inode = meta.ino();
    if head.len() > tail.head.len() {
        tail.head = head;
    }
    if meta.len() == tail.offset || file.seek(SeekFrom::Start(tail.offset)).is_err() {
        return false;
    }
    let mut bytes = Vec::new();
    if (&mut file).take(CHUNK).read_to_end(&mut bytes).is_err() {
        return false;
    }
    // Only complete lines: the rest is still being written.
    let Some(end) = bytes.iter().rposition(|&b| b == b'\n') else {
        return false;
    };
    for piece in bytes[..end].split(|&b| b == b'\n') {
        line(Some(&String::from_utf8_lossy(piece)));
    }
    tail.offset += end as u64 + 1;
    tail.offset < meta.len()
}

/// Tells when a followed file may have grown.
struct Changes {
    #[cfg(target_os = "linux")]
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl Changes {
    /// Watches the directories of `files`.
    #[cfg(target_os = "linux")]
    fn watch(files: &[PathBuf]) -> Result<Self, String> {
        use rustix::fs::inotify;
        let fd = inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC)
            .map_err(|e| format!("inotify: {e}"))?;
        for file in files {
            let dir = match file.parent() {
                _ if file.is_dir() => file.as_path(),
                Some(dir) if !dir.as_os_str().is_empty() => dir,
                _ => Path::new("."),
            };
            inotify::add_watch(
                &fd,
                dir,
                inotify::WatchFlags::MODIFY
                    | inotify::WatchFlags::CLOSE_WRITE
                    | inotify::WatchFlags::CREATE
                    | inotify::WatchFlags::MOVED_TO,
            )
            .map_err(|e| format!("{}: cannot watch: {e}", dir.display()))?;
        }
        // SAFETY: the `AsyncFd` owns the descriptor, so it stays open and unchanged for as
        // long as the `AsyncFd` lives.
        #[allow(unsafe_code)]
        let fd = unsafe { tokio::io::unix::AsyncFd::register(fd) }
            .map_err(|e| format!("inotify: {e}"))?;
        Ok(Self { fd })
    }

    #[cfg(not(target_os = "linux"))]
    fn watch(_files: &[PathBuf]) -> Result<Self, String> {
        Ok(Self {})
    }

    /// Returns when a watched directory changed, or after a second in any case.
    /// So a file on a filesystem that sends no events is still read.
    async fn next(&mut self) {
        #[cfg(target_os = "linux")]
        {
            let wait = async {
                if let Ok(mut ready) = self.fd.readable().await {
                    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
                    let mut events = rustix::fs::inotify::Reader::new(ready.get_inner(), &mut buf);
                    while events.next().is_ok() {}
                    ready.clear_ready();
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), wait).await;
        }
        #[cfg(not(target_os = "linux"))]
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn granted(owner: &str, token: u64, at: u64) -> String {
        format!(
            r#"{{"kind":"granted","at_ms":{at},"backend":"redis","name":"n","mode":"exclusive","owner":"{owner}","token":{token},"sent_ms":{at},"lease_ms":30000}}"#
        )
    }

    fn released(owner: &str, token: u64, at: u64) -> String {
        format!(
            r#"{{"kind":"released","at_ms":{at},"backend":"redis","name":"n","mode":"exclusive","owner":"{owner}","token":{token}}}"#
        )
    }

    /// Appends `lines` to `path` in one write.
    fn append(path: &Path, lines: &[String]) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        file.write_all(format!("{}\n", lines.join("\n")).as_bytes())
            .unwrap();
    }

    #[test]
    fn only_complete_lines_are_read_and_only_a_new_record_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.jsonl");
        std::fs::write(&path, "one\ntw").unwrap();
        let mut tail = Tail {
            path: path.clone(),
            ..Tail::default()
        };

        let mut read = Vec::new();
        read_new(&mut tail, |l| {
            read.push(l.unwrap_or("(started over)").to_owned())
        });
        assert_eq!(read, ["one"]);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"o\nthree\n")
            .unwrap();
        read_new(&mut tail, |l| {
            read.push(l.unwrap_or("(started over)").to_owned())
        });
        assert_eq!(read, ["one", "two", "three"]);
        // Replaced by a copy of itself (write and rename, as a shipper does): read on.
        let copy = dir.path().join("a.jsonl.tmp");
        std::fs::write(&copy, "one\ntwo\nthree\nfive\n").unwrap();
        std::fs::rename(&copy, &path).unwrap();
        read_new(&mut tail, |l| {
            read.push(l.unwrap_or("(started over)").to_owned())
        });
        assert_eq!(read, ["one", "two", "three", "five"]);
        // Truncated, or replaced by another record: from its start.
        std::fs::write(&path, "four\n").unwrap();
        read_new(&mut tail, |l| {
            read.push(l.unwrap_or("(started over)").to_owned())
        });
        assert_eq!(
            read,
            ["one", "two", "three", "five", "(started over)", "four"]
        );
        std::fs::write(&copy, "six\nseven\neight\nnine\nten\n").unwrap();
        std::fs::rename(&copy, &path).unwrap();
        read_new(&mut tail, |l| {
            read.push(l.unwrap_or("(started over)").to_owned())
        });
        assert_eq!(
            read[6..],
            ["(started over)", "six", "seven", "eight", "nine", "ten"]
        );
    }

    #[tokio::test]
    async fn hosts_streaming_their_events_are_audited_as_they_send() {
        use tokio::io::AsyncWriteExt as _;
        let address: std::net::SocketAddr = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let mut spec = Spec::new(Vec::new(), 5);
        spec.listen = Some(address);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (found, mut findings) = tokio::sync::mpsc::unbounded_channel();
        let auditing = tokio::spawn(async move {
            follow(&spec, async { stopped.await.unwrap_or(()) }, |f| {
                found.send(f.clone()).unwrap();
            })
            .await
        });
        let connect = || async {
            loop {
                // The auditor binds in its own task: until then, connections are refused.
                match tokio::net::TcpStream::connect(address).await {
                    Ok(stream) => return stream,
                    // Its port taken meanwhile: the auditor ended, and nothing will listen.
                    Err(e) if auditing.is_finished() => panic!("the auditor is gone: {e}"),
                    Err(_) => tokio::task::yield_now().await,
                }
            }
        };
        // x names itself; the other is named by its address.
        let mut x = connect().await;
        let hello = r#"{"host":"x"}"#.to_owned();
        x.write_all(format!("{hello}\n{}\n", granted("a1", 1, 1_000)).as_bytes())
            .await
            .unwrap();
        let mut other = connect().await;
        other
            .write_all(
                format!(
                    "{}\n{}\n",
                    granted("b1", 2, 1_500),
                    released("b1", 2, 1_800)
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        x.write_all(format!("{}\n", released("a1", 1, 2_000)).as_bytes())
            .await
            .unwrap();
        let finding = findings.recv().await.unwrap();
        assert_eq!(finding.check, "double_grant");
        assert!(finding.detail.contains("x token 1"), "{}", finding.detail);
        // x connects again, under its name, after a line too long: it goes on as the same
        // host, and its hold over b2's is found.
        drop(x);
        let mut again = connect().await;
        again
            .write_all(&vec![b'{'; super::super::listen::MAX_LINE + 10])
            .await
            .unwrap();
        again
            .write_all(
                format!(
                    "\n{hello}\n{}\n{}\n",
                    granted("a2", 3, 3_000),
                    released("a2", 3, 3_400)
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        other
            .write_all(
                format!(
                    "{}\n{}\n",
                    granted("b2", 4, 3_100),
                    released("b2", 4, 3_200)
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        let finding = findings.recv().await.unwrap();
        assert!(finding.detail.contains("x token 3"), "{}", finding.detail);
        stop.send(()).unwrap();
        let report = auditing.await.unwrap().unwrap();
        assert_eq!(report.findings.len(), 2, "{:?}", report.findings);
        assert_eq!(report.hosts.len(), 2, "{:?}", report.hosts);
        assert!(report.hosts.contains(&"x".to_owned()));
        assert_eq!(report.events["granted"], 4, "{:?}", report.events);
        assert_eq!(report.unreadable, 1);
    }

    #[tokio::test]
    async fn findings_come_as_the_files_grow_and_a_restart_resumes_where_it_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
        let mut spec = Spec::new(vec![a.clone(), b.clone()], 5);
        spec.state = Some(dir.path().join("audit.state"));

        // First run: a's second hold is still open when it stops.
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (found, mut findings) = tokio::sync::mpsc::unbounded_channel();
        let first = tokio::spawn({
            let spec = spec.clone();
            async move {
                follow(&spec, async { stopped.await.unwrap_or(()) }, |f| {
                    found.send(f.clone()).unwrap();
                })
                .await
            }
        });
        append(
            &a,
            &[
                granted("a1", 1, 1_000),
                released("a1", 1, 2_000),
                granted("a2", 3, 5_000),
            ],
        );
        append(&b, &[granted("b1", 2, 1_500), released("b1", 2, 1_800)]);
        let finding = findings.recv().await.unwrap();
        assert_eq!(finding.check, "double_grant");
        assert!(finding.detail.contains("a token 1") && finding.detail.contains("b token 2"));
        stop.send(()).unwrap();
        let report = first.await.unwrap().unwrap();
        assert_eq!(report.findings.len(), 1);

        // Second run, from the saved state: b's grant over a2's hold, which only the state
        // remembers, is found; the first run's finding is not made again.
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (found, mut findings) = tokio::sync::mpsc::unbounded_channel();
        let second = tokio::spawn({
            let spec = spec.clone();
            async move {
                follow(&spec, async { stopped.await.unwrap_or(()) }, |f| {
                    found.send(f.clone()).unwrap();
                })
                .await
            }
        });
        append(&b, &[granted("b2", 4, 5_500), released("b2", 4, 5_600)]);
        append(&a, &[released("a2", 3, 6_000)]);
        let finding = findings.recv().await.unwrap();
        assert!(finding.detail.contains("a token 3") && finding.detail.contains("b token 4"));
        stop.send(()).unwrap();
        let report = second.await.unwrap().unwrap();
        assert_eq!(report.findings.len(), 1, "{:?}", report.findings);
        // The counts go on from the first run's: four grants in all, each read once.
        assert_eq!(report.events["granted"], 4);

        // A state saved for other files is refused, not misapplied.
        let mut other = spec.clone();
        other.files.reverse();
        let refused = follow(&other, async {}, |_| {}).await.unwrap_err();
        assert!(refused.contains("saved for other files"), "{refused}");
    }
}
