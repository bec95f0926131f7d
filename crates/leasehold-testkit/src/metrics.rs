//! Reading the metrics a test's calls reported.
//! From a Prometheus exporter over HTTP, or from a recorder installed in the test process.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The exposition text a Prometheus exporter serves at loopback `port`'s `/metrics`.
///
/// # Panics
///
/// If the exporter cannot be reached or does not answer 200.
pub async fn scrape_metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("no exporter on port {port}: {e}"));
    let mut response = String::new();
    let exchanged = async {
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await?;
        stream.read_to_string(&mut response).await
    };
    if let Err(error) = exchanged.await {
        panic!("scraping port {port}: {error}");
    }
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// The exposition text of every metric this process reported since its first call.
/// The first call installs a Prometheus recorder as the process's recorder; metrics
/// reported before it are not recorded.
///
/// # Panics
///
/// If another recorder was installed in this process first.
pub fn recorded_metrics() -> String {
    static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();
    RECORDER
        .get_or_init(|| {
            PrometheusBuilder::new()
                .install_recorder()
                .unwrap_or_else(|e| panic!("installing a metrics recorder: {e}"))
        })
        .render()
}

/// The value of the series `metric` in exposition `text` whose labels include all of `labels`.
/// Each label is written as it is exposed (`fence="postgres"`). A series labelled with a
/// lock's name matches only when `labels` name it.
pub fn metric_value(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    let named = labels.iter().any(|l| l.starts_with("name="));
    text.lines()
        .filter(|line| named || !line.contains("name=\""))
        .filter(|line| {
            line.starts_with(&format!("{metric}{{")) || line.starts_with(&format!("{metric} "))
        })
        .find(|line| labels.iter().all(|l| line.contains(l)))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
