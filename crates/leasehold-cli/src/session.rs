//! `--ttl` on backends whose grants live as long as a session (etcd, ZooKeeper, PostgreSQL
//! in advisory mode).
//!
//! There a grant is not a lease of its own: it lasts as long as the client's session, whose
//! ttl is set when connecting (a URL parameter). `leasehold run` holds one lock per
//! process, so its lock's ttl and its session's ttl are one thing: the session ttl is set
//! from `--ttl` when the URL does not set it, `--ttl` is taken from the URL when only the URL
//! sets it, and the two must agree when both do.

use std::time::Duration;

use leasehold::{Error, parse_duration};

/// The ttl of `leasehold run` when neither `--ttl` nor the URL gives one.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// A backend whose grants follow a session.
#[derive(Debug)]
struct SessionScheme {
    /// URL schemes.
    schemes: &'static [&'static str],
    /// The URL parameter that sets the session's ttl.
    param: &'static str,
    /// The backend's ttls are multiples of this (rounded up).
    granularity: Duration,
    /// The URL parameter and value that make grants follow the session, if they do only in
    /// one mode.
    only_with: Option<(&'static str, &'static str)>,
}

/// Every session backend, with the URL parameter of its session ttl: the one place to
/// add one.
const SESSION_SCHEMES: &[SessionScheme] = &[
    SessionScheme {
        schemes: &["etcd", "etcds"],
        param: "session_ttl",
        granularity: Duration::from_secs(1),
        only_with: None,
    },
    SessionScheme {
        schemes: &["zk", "zookeeper"],
        param: "session_timeout",
        granularity: Duration::from_millis(1),
        only_with: None,
    },
    SessionScheme {
        schemes: &["postgres", "postgresql"],
        param: "session_ttl",
        granularity: Duration::from_millis(1),
        only_with: Some(("mode", "advisory")),
    },
];

/// The URL to connect to and the lock ttl of `leasehold run`, given `--ttl` (if given) and
/// the URL. On a session backend the URL comes back with the session ttl set, and the ttl
/// rounded up to the backend's granularity, so that the lock's ttl and its session's are
/// the same.
///
/// # Errors
///
/// [`Error::InvalidArgument`] if the URL sets the session ttl to something else than
/// `--ttl`, or to something that is not a duration.
pub fn apply_ttl(url: &str, ttl: Option<Duration>) -> Result<(String, Duration), Error> {
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .unwrap_or_default();
    let query = url.split_once('?').map_or("", |(_, query)| query);
    let params: Vec<(&str, &str)> = query.split('&').filter_map(|p| p.split_once('=')).collect();
    let Some(session) = SESSION_SCHEMES.iter().find(|s| {
        s.schemes.contains(&scheme.as_str())
            && s.only_with.is_none_or(|wanted| params.contains(&wanted))
    }) else {
        return Ok((url.to_owned(), ttl.unwrap_or(DEFAULT_TTL)));
    };
    let in_url = params
        .iter()
        .find(|(key, _)| *key == session.param)
        .map(|(_, value)| *value);
    match (in_url, ttl) {
        (Some(value), given) => {
            let from_url = parse_duration(value).map_err(|e| match e {
                Error::InvalidArgument { reason, .. } => {
                    Error::invalid("url", format!("{}: {reason}", session.param))
                }
                other => other,
            })?;
            if let Some(given) = given
                && given != from_url
            {
                return Err(Error::invalid(
                    "--ttl",
                    format!(
                        "--ttl {given:?} and the URL's {}={value} disagree; on {scheme}:// the \
                         lock lives as long as the session, so give one of them (or the same \
                         value in both)",
                        session.param
                    ),
                ));
            }
            Ok((url.to_owned(), round_up(from_url, session.granularity)))
        }
        (None, given) => {
            let ttl = round_up(given.unwrap_or(DEFAULT_TTL), session.granularity);
            let separator = if url.contains('?') { '&' } else { '?' };
            Ok((
                format!("{url}{separator}{}={}ms", session.param, ttl.as_millis()),
                ttl,
            ))
        }
    }
}

/// `ttl` rounded up to a multiple of `unit`.
fn round_up(ttl: Duration, unit: Duration) -> Duration {
    let (ttl_ns, unit_ns) = (ttl.as_nanos(), unit.as_nanos().max(1));
    let rounded = ttl_ns.div_ceil(unit_ns) * unit_ns;
    Duration::from_nanos(u64::try_from(rounded).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step fails the test

    use super::*;

    #[test]
    fn ttl_and_session_ttl_are_one_thing_on_session_backends() {
        let secs = Duration::from_secs;
        // Not a session backend: the URL as it is.
        assert_eq!(
            apply_ttl("redis://h:1", Some(secs(2))).unwrap(),
            ("redis://h:1".into(), secs(2))
        );
        assert_eq!(apply_ttl("file:///x", None).unwrap().1, DEFAULT_TTL);
        // --ttl sets the session's.
        assert_eq!(
            apply_ttl("etcd://h:1", Some(secs(2))).unwrap(),
            ("etcd://h:1?session_ttl=2000ms".into(), secs(2))
        );
        assert_eq!(
            apply_ttl("etcd://h:1?prefix=p", Some(Duration::from_millis(1500))).unwrap(),
            ("etcd://h:1?prefix=p&session_ttl=2000ms".into(), secs(2))
        );
        assert_eq!(
            apply_ttl("ETCDS://h:1", None).unwrap(),
            ("ETCDS://h:1?session_ttl=30000ms".into(), secs(30))
        );
        // The URL's sets --ttl's.
        assert_eq!(
            apply_ttl("etcd://h:1?session_ttl=5s", None).unwrap(),
            ("etcd://h:1?session_ttl=5s".into(), secs(5))
        );
        assert_eq!(
            apply_ttl("etcd://h:1?session_ttl=5s", Some(secs(5)))
                .unwrap()
                .1,
            secs(5)
        );
        assert_eq!(
            apply_ttl("zk://h:1", Some(Duration::from_millis(2500))).unwrap(),
            (
                "zk://h:1?session_timeout=2500ms".into(),
                Duration::from_millis(2500)
            )
        );
        // PostgreSQL's grants follow a session in advisory mode only.
        assert_eq!(
            apply_ttl("postgres://h/db?mode=advisory", Some(secs(60))).unwrap(),
            (
                "postgres://h/db?mode=advisory&session_ttl=60000ms".into(),
                secs(60)
            )
        );
        assert_eq!(
            apply_ttl("postgresql://h/db?session_ttl=5s&mode=advisory", None).unwrap(),
            (
                "postgresql://h/db?session_ttl=5s&mode=advisory".into(),
                secs(5)
            )
        );
        for lease in [
            "postgres://h/db",
            "postgres://h/db?mode=lease&session_ttl=5s",
        ] {
            assert_eq!(
                apply_ttl(lease, Some(secs(60))).unwrap(),
                (lease.into(), secs(60))
            );
        }
        // Disagreement and nonsense are usage errors.
        for bad in [
            apply_ttl("etcd://h:1?session_ttl=5s", Some(secs(2))),
            apply_ttl("etcd://h:1?session_ttl=5", None),
            apply_ttl(
                "postgres://h/db?mode=advisory&session_ttl=5s",
                Some(secs(60)),
            ),
        ] {
            assert!(matches!(bad, Err(Error::InvalidArgument { .. })), "{bad:?}");
        }
    }
}
