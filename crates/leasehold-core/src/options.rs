//! Lock options and duration parsing.

use std::time::Duration;

use crate::error::{Error, Result};

/// The longest lease, lock-delay, hold cap or request timeout accepted.
/// It is long enough for any real use, short enough that adding it to a clock reading can
/// never overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// How a lock is held.
/// Lease length, renewal cadence, clock-drift allowance, fairness, lock-delay, hold cap and
/// request timeout. Built and validated by [`LockOptions::builder`]; invalid values are
/// rejected, never silently replaced.
///
/// ```
/// use std::time::Duration;
/// use leasehold_core::LockOptions;
///
/// let options = LockOptions::builder().ttl(Duration::from_secs(10)).build()?;
/// assert_eq!(options.renew_every(), Duration::from_secs(10) / 3);
///
/// // A renewal interval that does not fit inside the lease is an error, not a silent fix.
/// assert!(LockOptions::builder()
///     .ttl(Duration::from_secs(10))
///     .renew_every(Duration::from_secs(10))
///     .build()
///     .is_err());
/// # Ok::<(), leasehold_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LockOptions {
    /// `None`: [`DEFAULT_TTL`], or the session's on a backend whose grants live by one.
    ttl: Option<Duration>,
    renew_every: Option<Duration>,
    drift_factor: f64,
    drift_margin: Duration,
    fair: Option<bool>,
    lock_delay: Option<Duration>,
    max_hold: Option<Duration>,
    request_timeout: Duration,
    metric_name: bool,
}

/// The lease length of locks whose options do not set one.
/// On backends whose grants live by a session, the session's ttl applies instead.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

impl Default for LockOptions {
    /// A 30 s lease renewed every 10 s, 1 % + 2 ms drift allowance, the backend's natural fairness.
    /// No lock-delay, no hold cap, 5 s request timeout.
    fn default() -> Self {
        Self {
            ttl: None,
            renew_every: None,
            drift_factor: 0.01,
            drift_margin: Duration::from_millis(2),
            fair: None,
            lock_delay: None,
            max_hold: None,
            request_timeout: Duration::from_secs(5),
            metric_name: false,
        }
    }
}

impl LockOptions {
    /// A builder starting from the defaults.
    pub fn builder() -> LockOptionsBuilder {
        LockOptionsBuilder(Self::default())
    }

    /// A builder starting from these options.
    pub fn to_builder(&self) -> LockOptionsBuilder {
        LockOptionsBuilder(self.clone())
    }

    /// The lease length asked of the server: the one set, or [`DEFAULT_TTL`].
    /// The server may round it up (e.g. etcd leases are whole seconds); deadlines always
    /// use the length it actually granted.
    pub fn ttl(&self) -> Duration {
        self.ttl.unwrap_or(DEFAULT_TTL)
    }

    /// The lease length set with [`LockOptionsBuilder::ttl`], if one was.
    /// A backend whose grants live by a session refuses a lock whose set ttl differs from
    /// the session's, rather than silently using the session's.
    pub fn chosen_ttl(&self) -> Option<Duration> {
        self.ttl
    }

    /// How often the watchdog renews a lease: the configured interval, or a third of the lease.
    pub fn renew_every(&self) -> Duration {
        self.renew_every.unwrap_or(self.ttl() / 3)
    }

    /// The fraction of a lease subtracted from it to allow for clocks running at different rates.
    pub fn drift_factor(&self) -> f64 {
        self.drift_factor
    }

    /// The fixed time subtracted from every lease on top of the drift fraction.
    pub fn drift_margin(&self) -> Duration {
        self.drift_margin
    }

    /// `Some(true)`: first come, first served (fails on a backend that cannot queue).
    /// `Some(false)`: no queue; `None`: the backend's natural behaviour.
    pub fn fair(&self) -> Option<bool> {
        self.fair
    }

    /// How long the lock stays closed after a holder's lease expires without a release.
    /// This is Chubby's lock-delay. A normal release opens it at once.
    pub fn lock_delay(&self) -> Option<Duration> {
        self.lock_delay
    }

    /// The longest time a guard is renewed for; after it the lease is left to run out.
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// Whether the lock's metrics carry its name as a label (see [`telemetry`](crate::telemetry)).
    /// Off by default: names can be countless, and each is a series of its own.
    pub fn metric_name(&self) -> bool {
        self.metric_name
    }

    /// The longest wait for any single answer from the backend.
    /// A request without an answer in time has an unknown outcome, which the engine
    /// resolves.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// The part of a lease of length `granted` that the holder may count on.
    /// It is measured from the moment the request was sent: `granted - (granted *
    /// drift_factor + drift_margin)`. `None` when nothing is left.
    pub fn validity(&self, granted: Duration) -> Option<Duration> {
        let drift = granted.mul_f64(self.drift_factor) + self.drift_margin;
        granted.checked_sub(drift).filter(|v| !v.is_zero())
    }

    fn validate(self) -> Result<Self> {
        check_range("ttl", self.ttl())?;
        if !self.drift_factor.is_finite() || !(0.0..0.5).contains(&self.drift_factor) {
            return Err(Error::invalid(
                "drift factor",
                format!(
                    "{} is outside [0, 0.5); the usual value is 0.01",
                    self.drift_factor
                ),
            ));
        }
        if self.drift_margin > MAX_DURATION {
            return Err(Error::invalid(
                "drift margin",
                format!("{:?} is longer than {MAX_DURATION:?}", self.drift_margin),
            ));
        }
        let Some(validity) = self.validity(self.ttl()) else {
            return Err(Error::invalid(
                "ttl",
                format!(
                    "a {:?} lease leaves nothing after the drift allowance ({} of the lease + {:?})",
                    self.ttl(),
                    self.drift_factor,
                    self.drift_margin
                ),
            ));
        };
        if let Some(every) = self.renew_every {
            check_range("renewal interval", every)?;
            if every >= validity {
                return Err(Error::invalid(
                    "renewal interval",
                    format!(
                        "{every:?} is not shorter than the {validity:?} a {:?} lease can be \
                         counted on; renew more often or use a longer ttl",
                        self.ttl()
                    ),
                ));
            }
        }
        if let Some(delay) = self.lock_delay {
            check_range("lock delay", delay)?;
        }
        if let Some(cap) = self.max_hold {
            check_range("maximum hold time", cap)?;
        }
        check_range("request timeout", self.request_timeout)?;
        Ok(self)
    }
}

fn check_range(what: &'static str, d: Duration) -> Result<Duration> {
    if d.is_zero() {
        return Err(Error::invalid(what, "must be longer than zero"));
    }
    if d > MAX_DURATION {
        return Err(Error::invalid(
            what,
            format!("{d:?} is longer than the limit of {MAX_DURATION:?}"),
        ));
    }
    Ok(d)
}

/// Builds [`LockOptions`]; [`build`](LockOptionsBuilder::build) validates.
#[derive(Debug, Clone)]
pub struct LockOptionsBuilder(LockOptions);

impl LockOptionsBuilder {
    /// See [`LockOptions::ttl`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.0.ttl = Some(ttl);
        self
    }

    /// Leaves the lease length unset.
    /// It is then [`DEFAULT_TTL`], or the session's on a backend whose grants live by one.
    pub fn default_ttl(mut self) -> Self {
        self.0.ttl = None;
        self
    }

    /// See [`LockOptions::renew_every`]. Must be shorter than the lease's validity.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.0.renew_every = Some(every);
        self
    }

    /// See [`LockOptions::drift_factor`]. Must be in `[0, 0.5)`.
    pub fn drift_factor(mut self, factor: f64) -> Self {
        self.0.drift_factor = factor;
        self
    }

    /// See [`LockOptions::drift_margin`].
    pub fn drift_margin(mut self, margin: Duration) -> Self {
        self.0.drift_margin = margin;
        self
    }

    /// See [`LockOptions::fair`].
    pub fn fair(mut self, fair: bool) -> Self {
        self.0.fair = Some(fair);
        self
    }

    /// See [`LockOptions::lock_delay`].
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.0.lock_delay = Some(delay);
        self
    }

    /// See [`LockOptions::max_hold`].
    pub fn max_hold(mut self, cap: Duration) -> Self {
        self.0.max_hold = Some(cap);
        self
    }

    /// See [`LockOptions::metric_name`].
    pub fn metric_name(mut self, on: bool) -> Self {
        self.0.metric_name = on;
        self
    }

    /// See [`LockOptions::request_timeout`].
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.0.request_timeout = timeout;
        self
    }

    /// Checks every value.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the first bad value: a zero or over-long duration,
    /// a drift factor outside `[0, 0.5)`, a lease that the drift allowance consumes, or a
    /// renewal interval not shorter than the lease's validity.
    pub fn build(self) -> Result<LockOptions> {
        self.0.validate()
    }
}

/// How to connect, beyond what a URL says: the session ttl.
/// Only a backend whose grants live by a session (etcd, ZooKeeper, PostgreSQL advisory
/// locks) uses it; the others ignore it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// The ttl, and whether a URL's own wins over it.
    session_ttl: Option<(Duration, bool)>,
}

impl ConnectOptions {
    /// The session ttl: every grant's lease; a URL that sets another is refused.
    /// The backend may refuse it too, or round it up (etcd: whole seconds; ZooKeeper: into
    /// the server's bounds): the one granted is its
    /// [`Capabilities::session_ttl`](crate::Capabilities).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero or more than [`MAX_DURATION`].
    pub fn session_ttl(mut self, ttl: Duration) -> Result<Self> {
        self.session_ttl = Some((check_range("session ttl", ttl)?, false));
        Ok(self)
    }

    /// As [`session_ttl`](Self::session_ttl), but a URL that sets its own wins.
    ///
    /// # Errors
    ///
    /// As for [`session_ttl`](Self::session_ttl).
    pub fn default_session_ttl(mut self, ttl: Duration) -> Result<Self> {
        self.session_ttl = Some((check_range("session ttl", ttl)?, true));
        Ok(self)
    }

    /// For a backend: the session ttl to use, given the one its URL sets (`in_url`).
    /// `param` names the URL parameter that sets it; `None` means the backend's default.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the URL's and [`session_ttl`](Self::session_ttl) differ.
    pub fn session_ttl_for(
        &self,
        param: &str,
        in_url: Option<Duration>,
    ) -> Result<Option<Duration>> {
        match (in_url, self.session_ttl) {
            (Some(url), Some((asked, false))) if url != asked => Err(Error::invalid(
                "session ttl",
                format!(
                    "the URL's {param}={url:?} and the {asked:?} asked for when connecting \
                     disagree; a session has one ttl, so give it in one place (or the same in both)"
                ),
            )),
            (Some(ttl), _) => Ok(Some(ttl)),
            (None, asked) => Ok(asked.map(|(ttl, _)| ttl)),
        }
    }
}

/// Parses a duration written as a number and a unit: `250ms`, `30s`, `1.5s`, `2m`, `1h`.
///
/// Units: `ms`, `s`, `m`, `h`. A number without a unit is rejected (is `10` ten seconds or
/// ten milliseconds?), as are negative numbers and values that overflow.
///
/// ```
/// use std::time::Duration;
/// use leasehold_core::parse_duration;
///
/// assert_eq!(parse_duration("500ms")?, Duration::from_millis(500));
/// assert_eq!(parse_duration("1.5s")?, Duration::from_millis(1500));
/// assert!(parse_duration("10").is_err());
/// # Ok::<(), leasehold_core::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] saying what is wrong with the text.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let bad = |reason: String| Err(Error::invalid("duration", reason));
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    if t.starts_with('-') {
        return bad(format!("{text:?} is negative"));
    }
    if number.is_empty() {
        return bad(format!("{text:?} does not start with a number"));
    }
    let unit_nanos: u128 = match unit {
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "" => {
            return bad(format!(
                "{text:?} has no unit; write e.g. {number}s or {number}ms"
            ));
        }
        other => {
            return bad(format!(
                "unknown unit {other:?} in {text:?}; use ms, s, m or h"
            ));
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || fraction.contains('.') || fraction.len() > 9 {
        return bad(format!("{text:?} is not a number with a unit"));
    }
    let overflow = || Error::invalid("duration", format!("{text:?} is too long"));
    let whole: u128 = whole.parse().map_err(|_| overflow())?;
    let fraction_nanos: u128 = if fraction.is_empty() {
        0
    } else {
        let digits: u128 = fraction.parse().map_err(|_| overflow())?;
        digits * 10u128.pow(9 - fraction.len() as u32)
    };
    let nanos = whole
        .checked_mul(unit_nanos)
        .and_then(|n| n.checked_add(fraction_nanos * unit_nanos / 1_000_000_000))
        .ok_or_else(overflow)?;
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| overflow())?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid_what(r: Result<LockOptions>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { what, .. }) => what,
            other => panic!("expected an invalid argument, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        let o = LockOptions::builder().build().unwrap();
        assert_eq!(o, LockOptions::default());
        assert_eq!(o.renew_every(), Duration::from_secs(10));
        assert_eq!(
            o.validity(Duration::from_secs(30)),
            Some(Duration::from_millis(29_698))
        );
    }

    #[test]
    fn rejects_bad_values() {
        let b = LockOptions::builder;
        assert_eq!(invalid_what(b().ttl(Duration::ZERO).build()), "ttl");
        assert_eq!(invalid_what(b().ttl(Duration::MAX).build()), "ttl");
        assert_eq!(
            invalid_what(b().ttl(Duration::from_millis(2)).build()),
            "ttl"
        );
        assert_eq!(
            invalid_what(b().drift_factor(f64::NAN).build()),
            "drift factor"
        );
        assert_eq!(invalid_what(b().drift_factor(-0.1).build()), "drift factor");
        assert_eq!(invalid_what(b().drift_factor(0.5).build()), "drift factor");
        assert_eq!(
            invalid_what(b().renew_every(Duration::ZERO).build()),
            "renewal interval"
        );
        assert_eq!(
            invalid_what(b().renew_every(Duration::from_secs(30)).build()),
            "renewal interval"
        );
        assert_eq!(
            invalid_what(b().lock_delay(Duration::ZERO).build()),
            "lock delay"
        );
        assert_eq!(
            invalid_what(b().max_hold(Duration::ZERO).build()),
            "maximum hold time"
        );
        assert_eq!(
            invalid_what(b().request_timeout(Duration::ZERO).build()),
            "request timeout"
        );
        assert_eq!(
            invalid_what(b().request_timeout(Duration::MAX).build()),
            "request timeout"
        );
    }

    #[test]
    fn validity_subtracts_drift_from_the_granted_lease() {
        let o = LockOptions::builder()
            .drift_factor(0.1)
            .drift_margin(Duration::from_millis(100))
            .ttl(Duration::from_secs(10))
            .build()
            .unwrap();
        assert_eq!(
            o.validity(Duration::from_secs(10)),
            Some(Duration::from_millis(8_900))
        );
        // A granted lease shorter than the drift allowance is worth nothing.
        assert_eq!(o.validity(Duration::from_millis(100)), None);
    }

    #[test]
    fn parses_durations() {
        let ok = |s: &str| parse_duration(s).unwrap();
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("30s"), Duration::from_secs(30));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
        assert_eq!(ok("0.25ms"), Duration::from_micros(250));
        assert_eq!(ok(" 7s "), Duration::from_secs(7));
        assert_eq!(ok("0s"), Duration::ZERO);
        for bad in [
            "",
            "10",
            "-1s",
            "s",
            "1.2.3s",
            "1x",
            "1 s",
            ".s",
            "1.0000000001s",
            "99999999999999999999h",
            "18446744073709551616s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_session_ttl_asked_for_and_one_in_the_url_agree_or_are_refused() {
        let secs = Duration::from_secs;
        let asked = ConnectOptions::default().session_ttl(secs(60)).unwrap();
        let err = asked.session_ttl_for("ttl", Some(secs(5))).unwrap_err();
        assert!(err.to_string().contains("ttl=5s and the 60s"), "{err}");
        assert_eq!(
            asked.session_ttl_for("ttl", Some(secs(60))).unwrap(),
            Some(secs(60))
        );
        assert_eq!(asked.session_ttl_for("ttl", None).unwrap(), Some(secs(60)));
        let default = ConnectOptions::default()
            .default_session_ttl(secs(60))
            .unwrap();
        assert_eq!(
            default.session_ttl_for("ttl", Some(secs(5))).unwrap(),
            Some(secs(5))
        );
        assert_eq!(
            default.session_ttl_for("ttl", None).unwrap(),
            Some(secs(60))
        );
        let none = ConnectOptions::default();
        assert_eq!(
            none.session_ttl_for("ttl", Some(secs(5))).unwrap(),
            Some(secs(5))
        );
        assert_eq!(none.session_ttl_for("ttl", None).unwrap(), None);
        assert!(
            ConnectOptions::default()
                .session_ttl(Duration::ZERO)
                .is_err()
        );
        assert!(
            ConnectOptions::default()
                .default_session_ttl(MAX_DURATION * 2)
                .is_err()
        );
    }
}
