//! What the binary's end-to-end tests share.

use std::process::Stdio;

use tokio::process::Command;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

/// Starts 20 `leasehold run --url url` processes at once on one name, each doing a slow
/// read-increment-write of a counter file; asserts the counter ends at exactly 20 and the
/// tokens the commands saw, in the order they ran, strictly increase.
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
