//! The server harness against the real programs.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use leasehold_testkit::probe::Resp;
use leasehold_testkit::{Etcd, Postgres, Redis, RedisReplicated, ZooKeeper, redis_servers};
use rustix::process::{Pid, test_kill_process};

fn gone(pid: u32) -> bool {
    test_kill_process(Pid::from_raw(pid as i32).unwrap()) == Err(rustix::io::Errno::SRCH)
}

#[tokio::test]
async fn redis_serves_pauses_restarts_empty_and_dies_with_its_handle() {
    let mut redis = Redis::start().await.unwrap();
    assert_eq!(
        redis.command(&["SET", "k", "v"]).await.unwrap(),
        Resp::Simple("OK".into())
    );
    assert_eq!(
        redis.command(&["GET", "k"]).await.unwrap(),
        Resp::Bulk(Some(b"v".to_vec()))
    );

    redis.pause();
    let paused = redis.command(&["PING"]).await;
    assert_eq!(paused.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
    redis.resume();
    assert_eq!(
        redis.command(&["PING"]).await.unwrap(),
        Resp::Simple("PONG".into())
    );

    let port = redis.port();
    redis.restart().await.unwrap();
    assert_eq!(redis.port(), port);
    assert_eq!(
        redis.command(&["GET", "k"]).await.unwrap(),
        Resp::Bulk(None)
    );

    let pid = redis.process().pid().unwrap();
    drop(redis);
    assert!(gone(pid), "redis-server outlived its handle");
}

#[tokio::test]
async fn independent_redis_servers_do_not_share_data() {
    let servers = redis_servers(3).await.unwrap();
    servers[0].command(&["SET", "k", "0"]).await.unwrap();
    for server in &servers[1..] {
        assert_eq!(
            server.command(&["GET", "k"]).await.unwrap(),
            Resp::Bulk(None)
        );
    }
}

#[tokio::test]
async fn a_redis_replica_follows_its_primary_and_refuses_writes() {
    let pair = RedisReplicated::start().await.unwrap();
    let replies = pair
        .primary
        .commands(&[&["SET", "k", "v"], &["WAIT", "1", "5000"]])
        .await
        .unwrap();
    assert_eq!(replies[1], Resp::Integer(1));
    assert_eq!(
        pair.replica.command(&["GET", "k"]).await.unwrap(),
        Resp::Bulk(Some(b"v".to_vec()))
    );
    match pair.replica.command(&["SET", "k", "w"]).await.unwrap() {
        Resp::Error(e) => assert!(e.starts_with("READONLY"), "{e}"),
        other => panic!("the replica accepted a write: {other:?}"),
    }
    // A paused replica does not acknowledge.
    pair.replica.pause();
    let replies = pair
        .primary
        .commands(&[&["SET", "k", "x"], &["WAIT", "1", "200"]])
        .await
        .unwrap();
    assert_eq!(replies[1], Resp::Integer(0));
    pair.replica.resume();
}

#[tokio::test]
async fn an_etcd_member_serves_and_comes_back_after_a_kill() {
    let mut etcd = Etcd::start().await.unwrap();
    assert!(etcd.url().starts_with("etcd://127.0.0.1:"));
    assert_eq!(etcd.leader().await, Some(0));
    let member = &mut etcd.members()[0];
    member.process().kill();
    member.restart().await.unwrap();
    assert_eq!(etcd.leader().await, Some(0));
}

#[tokio::test]
async fn a_three_member_etcd_cluster_elects_one_leader_and_survives_losing_one() {
    let mut etcd = Etcd::cluster(3).await.unwrap();
    assert_eq!(etcd.endpoints().len(), 3);
    let leader = etcd.leader().await.expect("a leader");
    // Kill a follower: the other two keep a quorum and a leader.
    let follower = (leader + 1) % 3;
    etcd.members()[follower].process().kill();
    assert_eq!(etcd.leader().await, Some(leader));
    etcd.members()[follower].restart().await.unwrap();
}

#[tokio::test]
async fn zookeeper_runs_standalone_and_as_an_ensemble() {
    let mut standalone = ZooKeeper::start().await.unwrap();
    assert_eq!(
        standalone.servers()[0].mode().await.as_deref(),
        Some("standalone")
    );

    let mut ensemble = ZooKeeper::ensemble(3).await.unwrap();
    assert_eq!(ensemble.connect_string().split(',').count(), 3);
    let mut modes = Vec::new();
    for server in ensemble.servers() {
        modes.push(server.mode().await.unwrap_or_default());
    }
    modes.sort();
    assert_eq!(modes, ["follower", "follower", "leader"]);
}

#[tokio::test]
async fn postgres_runs_as_its_own_user_and_restarts_with_its_data() {
    let mut postgres = Postgres::start().await.unwrap();
    let psql = |sql: &str| {
        std::process::Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-tAc", sql, "-p"])
            .arg(postgres.port().to_string())
            .output()
            .unwrap()
    };
    let out = psql("create table t (x int)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(psql("insert into t values (42)").status.success());
    let out = psql("select current_user");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "postgres");
    postgres.restart().await.unwrap();
    let out = std::process::Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-tAc",
            "select x from t",
            "-p",
        ])
        .arg(postgres.port().to_string())
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");
}
