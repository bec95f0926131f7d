//! One reader for every backend's URL: scheme, credentials, hosts, path and parameters.
//! The query parameters are named by one table per backend
//! ([`url_params!`](crate::support::url_params)).
//!
//! `scheme://[user[:password]@]host[:port][,host[:port]…][/path][?name=value&…]`: the `url`
//! crate reads one host per authority, so the authority is split here, on its last `@` and
//! then on `,`; a host is `name`, `name:port` or `[IPv6]:port`. Percent-escapes are decoded
//! in the credentials, host names, path and values, strictly (a `%` starts an escape; `+`
//! is a plus). A parameter the backend does not know, or one given twice, is refused. Every
//! error is [`Error::InvalidArgument`] about `"url"`, showing the URL without its password.

use std::fmt;
use std::ops::RangeBounds;
use std::str::FromStr;
use std::time::Duration;

use crate::{Error, Result, parse_duration};

/// `url` with any password replaced by `***`, in the user info or a `password=` parameter.
/// For example `redis://user:secret@host` becomes `redis://user:***@host`. Every error and
/// log message that shows a URL goes through this.
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
    let (scheme, userinfo, hosts, path, query) = split(url);
    let mut out = match (scheme, userinfo.and_then(|info| info.split_once(':'))) {
        (Some(scheme), Some((user, _))) => format!("{scheme}://{user}:***@{hosts}{path}"),
        _ => url.split_once('?').map_or(url, |(head, _)| head).to_owned(),
    };
    if let Some(query) = query {
        let hide = |param: &str| match param.split_once('=') {
            Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
            _ => param.to_owned(),
        };
        let params: Vec<String> = query.split('&').map(hide).collect();
        out = format!("{out}?{}", params.join("&"));
    }
    out
}

/// A password: kept for the server, shown as `***` by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Keeps `password`.
    pub fn new(password: &str) -> Self {
        Secret(password.to_owned())
    }

    /// The password, to send to the server.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// `scheme://userinfo@hosts/path?query` as written, in its five parts.
/// In order: the scheme (`None` without `://`, and then all before `?` is the path), the
/// user info, the hosts, the path and the query.
type Split<'a> = (
    Option<&'a str>,
    Option<&'a str>,
    &'a str,
    &'a str,
    Option<&'a str>,
);

fn split(url: &str) -> Split<'_> {
    let (head, query) = url
        .split_once('?')
        .map_or((url, None), |(h, q)| (h, Some(q)));
    let Some((scheme, rest)) = head.split_once("://") else {
        return (None, None, "", head, query);
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(scheme), Some(userinfo), hosts, path, query),
        None => (Some(scheme), None, authority, path, query),
    }
}

/// The scheme `url` starts with, in lower case (`redis` of `redis://…`, `memory` of `memory:`).
pub fn scheme(url: &str) -> Option<String> {
    let (scheme, _) = url.split_once(':')?;
    let valid = |c: char| c.is_ascii_alphanumeric() || "+-.".contains(c);
    (!scheme.is_empty() && scheme.chars().all(valid)).then(|| scheme.to_ascii_lowercase())
}

/// A backend's URL parameters, each with its name in URLs.
/// [`url_params!`](crate::support::url_params) implements it from one list.
pub trait UrlParam: Copy + fmt::Debug + 'static {
    /// Every parameter, in the order messages list them.
    const ALL: &'static [Self];

    /// The parameter's name in URLs.
    fn name(self) -> &'static str;

    /// The parameter called `name`, if there is one.
    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|p| p.name() == name)
    }
}

/// Defines a backend's URL parameters and their [`UrlParam`] implementation from one list.
/// The list reads `enum Param { Prefix = "prefix", … }`; [`ParsedUrl::params`] reads a
/// URL's parameters as values of that enum.
#[doc(hidden)]
#[macro_export]
macro_rules! __url_params {
    ($(#[$meta:meta])* $vis:vis enum $enum:ident {
        $($(#[$doc:meta])* $variant:ident = $name:literal,)+
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $enum {
            $($(#[$doc])* $variant,)+
        }

        impl $crate::support::url::UrlParam for $enum {
            const ALL: &'static [Self] = &[$($enum::$variant,)+];

            fn name(self) -> &'static str {
                match self {
                    $($enum::$variant => $name,)+
                }
            }
        }
    };
}
#[doc(inline)]
pub use crate::__url_params as url_params;

/// One host of a URL: its name or address, and its port if given.
/// The name is percent-decoded (an IPv6 address without the brackets). `Display` writes the
/// host as the URL does (`h:1`, `[::1]:2`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Host {
    /// The name or address.
    pub name: String,
    /// The port, if the URL gives one.
    pub port: Option<u16>,
    text: String,
}

impl Host {
    fn parse(text: &str) -> std::result::Result<Host, String> {
        let port_of = |port: &str| match port.parse::<u16>() {
            Ok(port) if port != 0 => Ok(Some(port)),
            _ => Err(format!("{port:?} is not a port")),
        };
        let (name, port) = match text.strip_prefix('[').map(|rest| rest.split_once(']')) {
            Some(Some((address, ""))) => (address, None),
            Some(Some((address, after))) => match after.strip_prefix(':') {
                Some(port) => (address, port_of(port)?),
                None => return Err(format!("{text:?} is not [address]:port")),
            },
            Some(None) => return Err(format!("{text:?} has no closing ]")),
            None => match text.rsplit_once(':') {
                Some((name, port)) => (name, port_of(port)?),
                None => (text, None),
            },
        };
        if name.is_empty() {
            return Err(format!("{text:?} has no host name"));
        }
        let (text, name) = (text.to_owned(), decode(name)?);
        Ok(Host { name, port, text })
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A URL split into its parts (see the [module docs](self)). `Debug` hides the password.
#[non_exhaustive]
pub struct ParsedUrl {
    /// The scheme, in lower case.
    pub scheme: String,
    /// The user name, if the URL has credentials.
    pub user: Option<String>,
    /// The password, if the credentials have one (`user:password@`).
    pub password: Option<String>,
    userinfo: Option<String>,
    hosts: Vec<Host>,
    path: String,
    query: String,
    shown: String,
    form: &'static str,
}

impl fmt::Debug for ParsedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ParsedUrl").field(&self.shown).finish()
    }
}

impl ParsedUrl {
    /// Splits `url`, whose scheme must be one of `schemes` (lower case).
    /// `form` is what messages say is expected (`"redis://host:port"`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for another scheme, a host that is not `name[:port]` or
    /// `[address][:port]`, a port that is not 1–65535, or a bad escape in the credentials.
    pub fn parse(url: &str, schemes: &[&str], form: &'static str) -> Result<Self> {
        let shown = redact_url(url);
        let invalid = |reason: String| Error::invalid("url", format!("{shown}: {reason}"));
        let (scheme, userinfo, hosts, path, query) = split(url);
        let scheme = (scheme.map(str::to_ascii_lowercase))
            .filter(|scheme| schemes.contains(&scheme.as_str()))
            .ok_or_else(|| invalid(format!("expected {form}")))?;
        let (user, password) = match userinfo.map(|info| info.split_once(':').ok_or(info)) {
            Some(Ok((user, password))) => (Some(user), Some(decode(password).map_err(invalid)?)),
            Some(Err(user)) => (Some(user), None),
            None => (None, None),
        };
        let hosts = hosts
            .split(',')
            .map(str::trim)
            .filter(|host| !host.is_empty());
        Ok(ParsedUrl {
            scheme,
            user: user.map(decode).transpose().map_err(invalid)?,
            password,
            userinfo: userinfo.map(str::to_owned),
            hosts: hosts
                .map(|host| Host::parse(host).map_err(invalid))
                .collect::<Result<_>>()?,
            path: path.to_owned(),
            query: query.unwrap_or_default().to_owned(),
            shown,
            form,
        })
    }

    /// The hosts, if there are as many as `count` allows (else an error).
    pub fn hosts(&self, count: impl RangeBounds<usize>) -> Result<&[Host]> {
        match self.hosts.len() {
            n if count.contains(&n) => Ok(&self.hosts),
            0 => Err(self.invalid(format!("no host; expected {}", self.form))),
            n => Err(self.invalid(format!("{n} hosts; expected {}", self.form))),
        }
    }

    /// The path, percent-decoded: empty or starting with `/` (an error if not UTF-8).
    pub fn path(&self) -> Result<String> {
        decode(&self.path).map_err(|reason| self.invalid(reason))
    }

    /// The path, percent-decoded to bytes (a file path need not be UTF-8).
    pub fn path_bytes(&self) -> Result<Vec<u8>> {
        decode_bytes(&self.path).map_err(|reason| self.invalid(reason))
    }

    /// `host`'s URL under `scheme`: the same credentials and path as given, no parameters.
    pub fn with_host(&self, scheme: &str, host: &Host) -> String {
        self.with_address(scheme, &host.text, &self.path)
    }

    /// A URL with the same credentials as given, and `scheme`, `address` and `path`.
    /// The address (`host:port`) and path are put in as they are; no parameters.
    pub fn with_address(&self, scheme: &str, address: &str, path: &str) -> String {
        let userinfo = self.userinfo.as_ref().map(|info| format!("{info}@"));
        format!("{scheme}://{}{address}{path}", userinfo.unwrap_or_default())
    }

    /// The query parameters as `P`s with their values, in the order given.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a parameter `P` does not know (listing the known
    /// ones), one given twice, or a bad escape in a value.
    pub fn params<P: UrlParam>(&self) -> Result<Vec<(P, Value<'_>)>> {
        let mut params: Vec<(P, Value<'_>)> = Vec::new();
        for pair in self.query.split('&').filter(|p| !p.is_empty()) {
            let (key, text) = pair.split_once('=').unwrap_or((pair, ""));
            let Some(param) = P::from_name(key) else {
                let known: Vec<&str> = P::ALL.iter().map(|p| p.name()).collect();
                let known = known.join(", ");
                return Err(self.invalid(format!("unknown parameter {key:?}; known: {known}")));
            };
            if params.iter().any(|(p, _)| p.name() == key) {
                return Err(self.invalid(format!("the parameter {key} is given twice")));
            }
            let text = decode(text).map_err(|reason| self.invalid(format!("{key}: {reason}")))?;
            let (url, name) = (self, param.name());
            params.push((param, Value { url, name, text }));
        }
        Ok(params)
    }

    /// An [`Error::InvalidArgument`] about this URL, shown without its password.
    pub fn invalid(&self, reason: impl fmt::Display) -> Error {
        Error::invalid("url", format!("{}: {reason}", self.shown))
    }
}

/// A parameter's value, percent-decoded; its readers' errors name the parameter.
#[derive(Debug)]
pub struct Value<'a> {
    url: &'a ParsedUrl,
    name: &'static str,
    text: String,
}

impl Value<'_> {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The text as a duration (see [`parse_duration`]).
    pub fn duration(&self) -> Result<Duration> {
        parse_duration(&self.text).map_err(|error| match error {
            Error::InvalidArgument { reason, .. } => self.bad(reason),
            other => other,
        })
    }

    /// The text as `true` or `false`.
    pub fn boolean(&self) -> Result<bool> {
        (self.text.parse()).map_err(|_| self.bad(format!("{:?} is not true or false", self.text)))
    }

    /// The text as a number.
    pub fn number<T: FromStr>(&self) -> Result<T> {
        (self.text.parse()).map_err(|_| self.bad(format!("{:?} is not a number", self.text)))
    }

    /// The value the text names among `choices`.
    pub fn one_of<T: Copy>(&self, choices: &[(&str, T)]) -> Result<T> {
        if let Some((_, value)) = choices.iter().find(|(word, _)| *word == self.text) {
            return Ok(*value);
        }
        let words: Vec<&str> = choices.iter().map(|(word, _)| *word).collect();
        Err(self.bad(format!(
            "{:?} is not one of {}",
            self.text,
            words.join(", ")
        )))
    }

    fn bad(&self, reason: String) -> Error {
        self.url.invalid(format!("{}: {reason}", self.name))
    }
}

/// `text` with its percent-escapes decoded, as UTF-8.
fn decode(text: &str) -> std::result::Result<String, String> {
    String::from_utf8(decode_bytes(text)?).map_err(|_| "percent-escapes that are not UTF-8".into())
}

/// `text` with its percent-escapes decoded.
fn decode_bytes(text: &str) -> std::result::Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, after)) = rest.split_first() {
        rest = after;
        if byte != b'%' {
            out.push(byte);
            continue;
        }
        let hex = rest
            .get(..2)
            .filter(|hex| hex.iter().all(u8::is_ascii_hexdigit));
        let byte = hex.and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok());
        out.push(byte.ok_or("a % not followed by two hex digits")?);
        rest = &rest[2..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    url_params! {
        enum Param {
            Prefix = "prefix",
            Ttl = "ttl",
            Fair = "fair",
        }
    }

    fn parse(url: &str) -> Result<ParsedUrl> {
        ParsedUrl::parse(url, &["demo", "demos"], "demo://host:port")
    }

    fn reason(result: Result<impl fmt::Debug>) -> String {
        match result {
            Err(Error::InvalidArgument {
                what: "url",
                reason,
            }) => reason,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_part_is_read() {
        let url =
            parse("DEMO://u%3Ax:p%40ss@h1:1, [::1]:2,h3,/a%20b/c?prefix=x%26y&ttl=2s&fair=true")
                .unwrap();
        assert_eq!(url.scheme, "demo");
        assert_eq!(
            (url.user.as_deref(), url.password.as_deref()),
            (Some("u:x"), Some("p@ss"))
        );
        let hosts = url.hosts(1..).unwrap();
        let hosts: Vec<_> = hosts
            .iter()
            .map(|h| (h.to_string(), h.name.clone(), h.port))
            .collect();
        assert_eq!(
            hosts,
            [
                ("h1:1".into(), "h1".into(), Some(1)),
                ("[::1]:2".into(), "::1".into(), Some(2)),
                ("h3".into(), "h3".into(), None)
            ]
        );
        assert_eq!(url.path().unwrap(), "/a b/c");
        let params = url.params::<Param>().unwrap();
        assert_eq!(params[0].1.as_str(), "x&y");
        assert_eq!(params[1].1.duration().unwrap(), Duration::from_secs(2));
        assert!(params[2].1.boolean().unwrap());
        let first = &url.hosts(..).unwrap()[0];
        assert_eq!(url.with_host("x", first), "x://u%3Ax:p%40ss@h1:1/a%20b/c");
        let url = parse("demo://h").unwrap();
        assert_eq!(
            (
                url.user.as_deref(),
                url.password.as_deref(),
                url.path().unwrap()
            ),
            (None, None, "".into())
        );
        assert_eq!(url.with_host("x", &url.hosts(1..=1).unwrap()[0]), "x://h");
        let url = parse("demo://u@h").unwrap();
        assert_eq!(
            (url.user.as_deref(), url.password.as_deref()),
            (Some("u"), None)
        );
        assert_eq!(scheme("Memory:"), Some("memory".into()));
        assert_eq!(scheme("no url"), None);
        assert_eq!(scheme(":x"), None);
    }

    #[test]
    fn bad_urls_are_typed_errors_without_the_password() {
        for (url, expected) in [
            ("other://h:1", "expected demo://host:port"),
            ("demo:h:1", "expected demo://host:port"),
            ("demo://", "no host"),
            ("demo://h:0", "\"0\" is not a port"),
            ("demo://h:x", "\"x\" is not a port"),
            ("demo://h:", "\"\" is not a port"),
            ("demo://:1", "has no host name"),
            ("demo://[::1", "has no closing ]"),
            ("demo://[::1]x", "is not [address]:port"),
            ("demo://u:p%zz@h", "two hex digits"),
            ("demo://u:p%+1@h", "two hex digits"),
            (
                "demo://u:hunter2@h?nosuch=1",
                "unknown parameter \"nosuch\"; known: prefix, ttl, fair",
            ),
            (
                "demo://u:hunter2@h?ttl=1s&ttl=2s",
                "the parameter ttl is given twice",
            ),
            ("demo://u:hunter2@h?prefix=%", "prefix: a % not followed"),
            (
                "demo://h?prefix=%ff",
                "prefix: percent-escapes that are not UTF-8",
            ),
        ] {
            let reason = reason(parse(url).and_then(|url| {
                url.hosts(1..)?;
                url.params::<Param>().map(|_| ())
            }));
            assert!(reason.contains(expected), "{url}: {reason}");
            assert!(!reason.contains("hunter2"), "{reason}");
        }
        let url = parse("demo://u:hunter2@h1,h2?ttl=10&fair=maybe").unwrap();
        assert!(reason(url.hosts(1..=1)).contains("2 hosts; expected demo://host:port"));
        let params = url.params::<Param>().unwrap();
        let ttl = reason(params[0].1.duration());
        assert!(
            ttl.starts_with("demo://u:***@h1,h2") && ttl.contains("ttl: \"10\" has no unit"),
            "{ttl}"
        );
        assert!(reason(params[1].1.boolean()).contains("fair: \"maybe\" is not true or false"));
        assert!(
            reason(params[1].1.one_of(&[("a", 1), ("b", 2), ("c", 3)]))
                .contains("fair: \"maybe\" is not one of a, b, c")
        );
        assert!(reason(params[1].1.number::<u32>()).contains("is not a number"));
        assert!(reason(Err::<(), _>(url.invalid("x"))).starts_with("demo://u:***@"));
        assert!(!format!("{url:?}").contains("hunter2"));
        assert!(reason(parse("demo://h/%ff").unwrap().path()).contains("not UTF-8"));
        assert_eq!(
            parse("demo://h/%ff").unwrap().path_bytes().unwrap(),
            b"/\xff"
        );
    }

    #[test]
    fn passwords_never_survive_redaction() {
        for url in [
            "redis://u:s3cret@h:1",
            "rediss://:s3cret@h:1/2",
            "redlock://u:s3cret@h1:1,h2:2,h3:3",
            "etcd://h:1?password=s3cret",
            "postgres://u:s3cret@h/db?sslmode=disable&PASSWORD=s3cret",
            "redis://u:pa@ss:s3cret@h:1",
            "not a url?password=s3cret",
        ] {
            let redacted = redact_url(url);
            assert!(!redacted.contains("s3cret"), "{url} -> {redacted}");
        }
        assert_eq!(redact_url("redis://user@h:1"), "redis://user@h:1");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(redact_url("x?a=1&&password="), "x?a=1&&password=***");
        let secret = Secret::new("s3cret");
        assert_eq!(
            (format!("{secret:?}"), secret.expose()),
            ("***".into(), "s3cret")
        );
    }
}
