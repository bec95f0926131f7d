//! The fault proxy, in front of a small echo server that reports what it received.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use leasehold_faultproxy::{Direction, FaultProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// An echo server; every chunk it receives is also sent on the returned channel.
async fn echo() -> (SocketAddr, mpsc::UnboundedReceiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                loop {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            let _ = tx.send(buf[..n].to_vec());
                            if socket.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, rx)
}

async fn roundtrip(stream: &mut TcpStream, bytes: &[u8]) -> Vec<u8> {
    stream.write_all(bytes).await.unwrap();
    let mut back = vec![0u8; bytes.len()];
    stream.read_exact(&mut back).await.unwrap();
    back
}

#[tokio::test]
async fn bytes_pass_through_unchanged() {
    let (server, _) = echo().await;
    let proxy = FaultProxy::start(server).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut client, b"hello").await, b"hello");
    assert_eq!(proxy.connections(), 1);
}

#[tokio::test]
async fn a_delay_holds_each_direction_back() {
    let (server, _) = echo().await;
    let proxy = FaultProxy::start(server).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    proxy.set_delay(Direction::Both, Duration::from_millis(100));
    let started = Instant::now();
    assert_eq!(roundtrip(&mut client, b"x").await, b"x");
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn cutting_replies_lets_requests_through_and_heal_delivers_them_late() {
    let (server, mut received) = echo().await;
    let proxy = FaultProxy::start(server).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    proxy.cut(Direction::ToClient);
    client.write_all(b"ping").await.unwrap();
    // The server got the request...
    assert_eq!(received.recv().await.unwrap(), b"ping");
    // ...but the reply is held.
    let mut back = [0u8; 4];
    let early =
        tokio::time::timeout(Duration::from_millis(200), client.read_exact(&mut back)).await;
    assert!(early.is_err(), "a reply crossed a cut link");
    proxy.heal();
    client.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping");
}

#[tokio::test]
async fn cutting_requests_keeps_them_from_the_server_until_healed() {
    let (server, mut received) = echo().await;
    let proxy = FaultProxy::start(server).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut client, b"a").await, b"a");
    assert_eq!(received.recv().await.unwrap(), b"a");
    proxy.cut(Direction::ToServer);
    client.write_all(b"b").await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(200), received.recv()).await;
    assert!(early.is_err(), "a request crossed a cut link");
    proxy.heal();
    assert_eq!(received.recv().await.unwrap(), b"b");
}

#[tokio::test]
async fn reset_closes_every_connection_and_refuse_turns_new_ones_away() {
    let (server, _) = echo().await;
    let proxy = FaultProxy::start(server).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut client, b"a").await, b"a");
    proxy.reset();
    let mut buf = [0u8; 1];
    let read = client.read(&mut buf).await;
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");

    proxy.refuse_new(true);
    let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
    let _ = refused.write_all(b"x").await;
    let read = refused.read(&mut buf).await;
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    proxy.refuse_new(false);
    let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut again, b"c").await, b"c");
}

#[tokio::test]
async fn cutting_the_open_connections_lets_new_ones_through() {
    let (server, _) = echo().await;
    let proxy = FaultProxy::start(server).await.unwrap();
    let mut dead = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut dead, b"a").await, b"a");
    proxy.cut_open(Direction::Both);
    dead.write_all(b"b").await.unwrap();
    let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut fresh, b"c").await, b"c");
    let mut back = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(200), dead.read_exact(&mut back)).await;
    assert!(early.is_err(), "a cut connection answered");
    proxy.heal();
    dead.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"b");
}
