//! Keeping credentials out of messages.

/// `url` with any password replaced by `***`.
/// That is in the user-info part (`redis://user:secret@host` → `redis://user:***@host`) and
/// in `password=` query parameters. Every error and log message that shows a URL goes
/// through this.
///
/// ```
/// use leasehold_core::support::redact_url;
///
/// assert_eq!(redact_url("redis://app:hunter2@cache:6379/0"), "redis://app:***@cache:6379/0");
/// assert_eq!(redact_url("redis://:hunter2@cache"), "redis://:***@cache");
/// assert_eq!(redact_url("etcd://h1:2379,h2:2379?password=x&user=u"), "etcd://h1:2379,h2:2379?password=***&user=u");
/// assert_eq!(redact_url("file:///tmp/locks"), "file:///tmp/locks");
/// ```
pub fn redact_url(url: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let mut out = match head.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            match authority.rsplit_once('@') {
                Some((userinfo, hosts)) => {
                    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                    let hidden = if userinfo.contains(':') { ":***" } else { "" };
                    format!("{scheme}://{user}{hidden}@{hosts}{path}")
                }
                None => head.to_owned(),
            }
        }
        None => head.to_owned(),
    };
    if let Some(query) = query {
        out.push('?');
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                _ => param.to_owned(),
            })
            .collect();
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_never_survive() {
        for url in [
            "redis://u:s3cret@h:1",
            "rediss://:s3cret@h:1/2",
            "redlock://u:s3cret@h1:1,h2:2,h3:3",
            "etcd://h:1?password=s3cret",
            "postgres://u:s3cret@h/db?sslmode=disable&PASSWORD=s3cret",
            "redis://u:pa@ss:s3cret@h:1",
        ] {
            let redacted = redact_url(url);
            assert!(!redacted.contains("s3cret"), "{url} -> {redacted}");
        }
        assert_eq!(redact_url("redis://user@h:1"), "redis://user@h:1");
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
