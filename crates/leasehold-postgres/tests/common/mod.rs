//! What the PostgreSQL test files share: a plain connection, and waiting on the server.

use std::time::Duration;

use leasehold_postgres::tokio_postgres::{self, NoTls};

/// A plain connection to the server at `url`, its driver running on a task.
pub(crate) async fn database(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
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
