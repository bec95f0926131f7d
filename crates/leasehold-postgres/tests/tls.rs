//! TLS against a real PostgreSQL serving a certificate of a test CA.
//! The certificate is for 127.0.0.1 and localhost; each `sslmode` does what libpq's does.

#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use leasehold_core::{Client, Error};
use leasehold_postgres::PostgresBackend;
use leasehold_postgres::tokio_postgres::{self, NoTls};
use leasehold_testkit::Postgres;

async fn connect(url: &str) -> Result<PostgresBackend, Error> {
    PostgresBackend::connect(url).await
}

/// Whether every session of application `name` on the server is encrypted.
async fn encrypted(server: &Postgres, name: &str) -> bool {
    let (db, connection) = tokio_postgres::connect(&server.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    db.query_one(
        "SELECT count(*) > 0 AND bool_and(s.ssl) FROM pg_stat_ssl s \
         JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1",
        &[&name],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_checks_what_libpq_checks() {
    let server = Postgres::builder().tls().start().await.unwrap();
    let ca = server.ca_file().display().to_string();
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());
    let localhost = format!("postgres://postgres@localhost:{}/postgres", server.port());

    // Verified against the test CA, by IP address and by host name; locks work over it.
    for (url, app) in [(&base, "full-ip"), (&localhost, "full-name")] {
        let backend = connect(&format!(
            "{url}?sslmode=verify-full&tls_ca={ca}&application_name={app}"
        ))
        .await
        .unwrap();
        let client = Client::new(backend);
        let guard = client.mutex("job").unwrap().lock().await.unwrap();
        assert!(encrypted(&server, app).await, "{app} is not encrypted");
        guard.release().await.unwrap();
    }
    // The system's CAs do not know the test CA.
    let refused = connect(&format!("{base}?sslmode=verify-full")).await;
    assert!(
        matches!(&refused, Err(Error::Unavailable { message, .. }) if message.contains("UnknownIssuer")),
        "{refused:?}"
    );
    // `require` encrypts without checking; `disable` does not encrypt.
    let _require = connect(&format!("{base}?sslmode=require&application_name=require"))
        .await
        .unwrap();
    assert!(encrypted(&server, "require").await);
    let _plain = connect(&format!("{base}?sslmode=disable&application_name=plain"))
        .await
        .unwrap();
    assert!(!encrypted(&server, "plain").await);
    // TLS files without TLS are a typed error before anything is sent.
    assert!(matches!(
        connect(&format!("{base}?sslmode=disable&tls_ca={ca}")).await,
        Err(Error::InvalidArgument { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_fails_against_a_server_without_tls() {
    let server = Postgres::start().await.unwrap();
    let refused = connect(&format!("{}?sslmode=require", server.url())).await;
    assert!(
        matches!(
            refused,
            Err(Error::Unavailable { .. }) | Err(Error::Backend { .. })
        ),
        "{refused:?}"
    );
}
