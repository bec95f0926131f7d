//! `etcds://`: TLS to an etcd member, against a test CA the testkit makes for it.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use leasehold_core::{Client, Error};
use leasehold_etcd::EtcdBackend;
use leasehold_testkit::{ClientAuth, Etcd};

async fn connect(url: &str) -> Client {
    Client::builder(EtcdBackend::connect(url).await.unwrap()).build()
}

#[tokio::test]
async fn locks_over_tls_trusting_the_members_ca() {
    let etcd = Etcd::tls(ClientAuth::Optional).await.unwrap();
    let url = etcd.tls_url().unwrap();
    let (first, second) = (connect(&url).await, connect(&url).await);
    let (mine, theirs) = (first.mutex("job").unwrap(), second.mutex("job").unwrap());
    let held = mine.lock().await.unwrap();
    assert!(theirs.try_lock().await.unwrap().is_none(), "held over TLS");
    let token = held.token();
    held.release().await.unwrap();
    let next = theirs.try_lock().await.unwrap();
    assert!(next.expect("free after the release").token() > token);
}

#[tokio::test]
async fn a_member_certificate_nobody_vouches_for_is_refused() {
    let etcd = Etcd::tls(ClientAuth::Optional).await.unwrap();
    // The system's CAs do not know the test CA.
    let url = format!("etcds://{}?connect_timeout=2s", etcd.endpoints().join(","));
    let refused = EtcdBackend::connect(&url).await.unwrap_err();
    assert!(matches!(refused, Error::Unavailable { .. }), "{refused}");
    // Nor does a plain connection get through to the TLS port.
    let plain = url.replacen("etcds://", "etcd://", 1);
    let refused = EtcdBackend::connect(&plain).await.unwrap_err();
    assert!(matches!(refused, Error::Unavailable { .. }), "{refused}");
}

#[tokio::test]
async fn a_member_that_asks_for_a_client_certificate_gets_one() {
    let etcd = Etcd::tls(ClientAuth::Required).await.unwrap();
    let url = format!("{}&connect_timeout=2s", etcd.tls_url().unwrap());
    let refused = EtcdBackend::connect(&url).await.unwrap_err();
    assert!(
        matches!(refused, Error::Unavailable { .. }),
        "connected without the client certificate the member requires: {refused}"
    );
    let file = |name: &str| etcd.tls_file(name).unwrap().display().to_string();
    let with_certificate = format!(
        "{url}&tls_cert={}&tls_key={}",
        file("client.crt"),
        file("client.key")
    );
    let client = connect(&with_certificate).await;
    let first = client.mutex("job").unwrap().lock().await.unwrap();
    let token = first.token();
    first.release().await.unwrap();
    let second = client.mutex("job").unwrap().lock().await.unwrap();
    assert!(second.token() > token);
    // A client certificate file that holds none is a clear error, not a failed handshake.
    let wrong = format!(
        "{url}&tls_cert={}&tls_key={}",
        file("client.key"),
        file("client.key")
    );
    let invalid = EtcdBackend::connect(&wrong).await.unwrap_err();
    assert!(
        matches!(invalid, Error::InvalidArgument { .. }),
        "{invalid}"
    );
}
