//! What the PostgreSQL test files share: a plain connection, and waiting on the server.

use std::time::Duration;

use leasehold_postgres::tokio_postgres::{self, NoTls};
use leasehold_testkit::Postgres;

/// A plain connection to the server at `url`, its driver running on a task.
pub(crate) async fn database(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// A server whose statements `pg_stat_statements` counts, and a plain connection to it.
#[allow(dead_code, reason = "not every test file counts statements")]
pub(crate) async fn counting_server() -> (Postgres, tokio_postgres::Client) {
    let server = Postgres::builder()
        .config("shared_preload_libraries", "pg_stat_statements")
        .start()
        .await
        .unwrap();
    let db = database(&server.url()).await;
    db.batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    (server, db)
}

/// Polls the server until `sql` (one boolean) is true.
#[allow(dead_code, reason = "not every test file waits on the server")]
pub(crate) async fn until(db: &tokio_postgres::Client, sql: &str) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while !db.query_one(sql, &[]).await.unwrap().get::<_, bool>(0) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "never true: {sql}");
}

/// Makes schema `old` as a client of schema version `version` left it.
#[allow(dead_code, reason = "not every test file starts from an older schema")]
pub(crate) async fn old_schema(db: &tokio_postgres::Client, version: usize) {
    let migrations = [
        include_str!("../../sql/v1.sql"),
        include_str!("../../sql/v2.sql"),
        include_str!("../../sql/v3.sql"),
        include_str!("../../sql/v4.sql"),
    ];
    let sql: String = migrations[..version]
        .iter()
        .map(|sql| {
            sql.replace("@schema@", "old")
                .replace("@channel@", "old.wake")
        })
        .collect();
    db.batch_execute(&format!(
        "BEGIN; CREATE SCHEMA old; CREATE TABLE old.version (version integer NOT NULL); \
         {sql} INSERT INTO old.version VALUES ({version}); COMMIT"
    ))
    .await
    .unwrap();
}
