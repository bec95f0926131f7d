//! `rediss://`: TLS to redis-server, against a test CA the testkit makes for each server.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::time::Duration;

use leasehold_core::{Client, Error, LockOptions};
use leasehold_redis::{RedisBackend, RedlockBackend};
use leasehold_testkit::{ClientAuth, Redis};

async fn tls_server(clients: ClientAuth) -> Redis {
    Redis::builder().tls(clients).start().await.unwrap()
}

async fn one_cycle(client: &Client) -> u64 {
    let guard = client.mutex("job").unwrap().lock().await.unwrap();
    let token = guard.token().get();
    guard.release().await.unwrap();
    token
}

#[tokio::test]
async fn locks_over_tls_trusting_the_servers_ca() {
    let server = tls_server(ClientAuth::Optional).await;
    let url = server.tls_url().unwrap();
    let client = Client::builder(RedisBackend::connect(&url).await.unwrap()).build();
    let first = one_cycle(&client).await;
    assert!(one_cycle(&client).await > first);
    // The grants went through the TLS port: the plain port's server holds the same keys.
    let counter = server
        .command(&["EXISTS", "leasehold:{job}:token"])
        .await
        .unwrap();
    assert_eq!(counter, leasehold_testkit::probe::Resp::Integer(1));
}

#[tokio::test]
async fn a_server_certificate_nobody_vouches_for_is_refused() {
    let server = tls_server(ClientAuth::Optional).await;
    // The system's CAs do not know the test CA.
    let url = format!("rediss://127.0.0.1:{}", server.tls_port().unwrap());
    let refused = RedisBackend::connect(&url).await.unwrap_err();
    assert!(matches!(refused, Error::Unavailable { .. }), "{refused}");
    // Nor does a plain connection get through to the TLS port.
    let plain = url.replacen("rediss://", "redis://", 1);
    assert!(RedisBackend::connect(&plain).await.is_err());
}

#[tokio::test]
async fn a_server_that_asks_for_a_client_certificate_gets_one() {
    let server = tls_server(ClientAuth::Required).await;
    let url = server.tls_url().unwrap();
    assert!(
        RedisBackend::connect(&url).await.is_err(),
        "connected without the client certificate the server requires"
    );
    let file = |name: &str| server.tls_file(name).unwrap().display().to_string();
    let with_certificate = format!(
        "{url}&tls_cert={}&tls_key={}",
        file("client.crt"),
        file("client.key")
    );
    let client = Client::builder(RedisBackend::connect(&with_certificate).await.unwrap()).build();
    one_cycle(&client).await;
}

#[tokio::test]
async fn redlock_reaches_its_nodes_over_tls() {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(tls_server(ClientAuth::Optional).await);
    }
    // Each server has a CA of its own: trust all three.
    let bundle = std::env::temp_dir().join(format!("leasehold-cas-{}.pem", std::process::id()));
    let cas: Vec<u8> = nodes
        .iter()
        .flat_map(|n| std::fs::read(n.tls_file("ca.crt").unwrap()).unwrap())
        .collect();
    std::fs::write(&bundle, cas).unwrap();
    let hosts: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.tls_port().unwrap()))
        .collect();
    let url = format!(
        "redlock://{}?tls=true&tls_ca={}",
        hosts.join(","),
        bundle.display()
    );
    let backend = RedlockBackend::connect(&url).await.unwrap();
    let client = Client::builder(backend)
        .options(
            LockOptions::builder()
                .ttl(Duration::from_secs(5))
                .build()
                .unwrap(),
        )
        .build();
    let first = one_cycle(&client).await;
    assert!(one_cycle(&client).await > first);
    std::fs::remove_file(&bundle).unwrap();
}
