//! The HTML report in a real browser.
//! Headless Debian `chromium` loads the page of a real run, the page draws one lane per
//! worker without a script error, and a screenshot is taken.

mod common;

#[test]
fn the_html_timeline_renders_its_lanes_in_headless_chromium() {
    // A run with a violation to mark: Redis restarted empty under a holder.
    let mut report = common::run(&common::spec("redis", "restart-empty", 1));
    common::assert_good("redis restart-empty", std::slice::from_mut(&mut report));
    let lanes = report
        .history
        .as_ref()
        .map(|h| {
            h.events()
                .iter()
                .filter(|e| e.process.starts_with('w'))
                .map(|e| e.process.clone())
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        })
        .unwrap_or(0);
    assert_eq!(lanes, 3);
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    std::fs::write(&page, leasehold_chaos::report::html(&[report])).unwrap();
    let url = format!("file://{}", page.display());

    let profile = tempfile::tempdir().unwrap();
    let dom = common::chromium(profile.path(), &["--dump-dom", &url]);
    let dom_text = String::from_utf8_lossy(&dom.stdout);
    assert!(
        dom_text.contains(&format!("data-rendered=\"{lanes}\"")),
        "the page did not draw {lanes} lanes (stderr: {})\n{}",
        String::from_utf8_lossy(&dom.stderr),
        &dom_text[..dom_text.len().min(2000)]
    );
    assert!(
        !dom_text.contains("data-error"),
        "a script error:\n{dom_text}"
    );
    assert_eq!(dom_text.matches("class=\"lane\"").count(), lanes);
    assert!(
        dom_text.contains("class=\"violation\""),
        "no violation marked"
    );
    assert!(dom_text.contains("class=\"fault\""), "no fault shaded");

    let profile = tempfile::tempdir().unwrap();
    let shot = dir.path().join("report.png");
    let out = common::chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1280,900",
            &url,
        ],
    );
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot ({e}); chromium said: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        png.len() > 10_000,
        "a {}-byte screenshot is blank",
        png.len()
    );
    if let Ok(keep) = std::env::var("LEASEHOLD_CHAOS_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
}
