//! The holders' side: C6 (perceived overlap) and C9 (loss timing, recovery).

use super::{Facts, Finding, Record, Violation, ms};
use crate::history::{Expiry, History, Kind, Phase};

/// C6: no two workers believed they held the lock at the same time.
/// A worker certainly believed it held from when it had its guard until the invoke of its
/// last read or write that found the guard held (it checked `is_held` after that invoke was
/// stamped). The overlap is measured.
pub(super) fn c6_perceived_overlap(facts: &Facts) -> Finding {
    let mut incomplete = facts.incomplete(Record::Hold);
    if facts.holds.is_empty() && incomplete.is_empty() {
        return Finding::nothing(facts, "no worker held the lock");
    }
    incomplete.extend(facts.incomplete(Record::Access));
    let mut violations = Vec::new();
    let (mut total, mut longest) = (0u64, 0u64);
    for (i, a) in facts.holds.iter().enumerate() {
        for b in &facts.holds[i + 1..] {
            if a.lock != b.lock || a.process == b.process {
                continue;
            }
            let from = a.start.max(b.start);
            let to = a.believed_until().min(b.believed_until());
            if from < to {
                let overlap = to - from;
                total += overlap;
                longest = longest.max(overlap);
                violations.push(Violation::during(
                    from,
                    to,
                    &[&a.process, &b.process],
                    format!(
                        "{} (token {}) and {} (token {}) both believed they held for {}",
                        a.process,
                        a.token,
                        b.process,
                        b.token,
                        ms(overlap)
                    ),
                ));
            }
        }
    }
    Finding::measured(
        violations,
        format!(
            "{} guards; overlap total {}, longest {}",
            facts.holds.len(),
            ms(total),
            ms(longest)
        ),
    )
    .breaking(incomplete)
}

/// C9: no guard is held past the server's promise, and a vanished holder's lock passes on in time.
/// (a) A guard is never found held after its lease could have expired on the server (its
/// last promise: a lease counted from its request's send; a session's ttl past the last
/// keep-alive the server acknowledged — the server's bound, not the client's own deadline),
/// nor after the server answered that the owner no longer holds it; (b) when a holder is
/// killed, or paused past its lease, a waiting worker is granted the lock within the
/// lease + lock-delay + slack (by the send of the request that was granted: an answer that
/// came late is its link's or its worker's delay, not the lock's).
pub(super) fn c9_loss_timing(history: &History, facts: &Facts) -> Finding {
    let mut broken = facts.incomplete(Record::Hold);
    let held = !(facts.holds.is_empty() && broken.is_empty());
    let mut violations = Vec::new();
    for hold in &facts.holds {
        let Some(grant) = facts.grant(&hold.lock, &hold.owner, hold.token) else {
            broken.push(Violation::at(
                hold.start,
                &[&hold.process],
                format!(
                    "{} had a guard (token {}, owner {}) that no recorded grant of the server's explains",
                    hold.process, hold.token, hold.owner
                ),
            ));
            continue;
        };
        let expires = !matches!(grant.expiry, Expiry::Never);
        for access in hold.accesses.iter().filter(|a| a.held) {
            let Some(promise) = grant.server_promise_before(access.completed) else {
                broken.push(Violation::at(
                    access.invoked,
                    &[&hold.process],
                    format!(
                        "the session of {}'s grant (token {}) does not say when the server may end it: its guard cannot be held against the server's bound",
                        hold.process, hold.token
                    ),
                ));
                break;
            };
            if expires && access.invoked >= promise {
                violations.push(Violation::during(
                    promise,
                    access.invoked,
                    &[&hold.process],
                    format!(
                        "{} still found its guard (token {}) held {} after its lease could have expired on the server",
                        hold.process,
                        hold.token,
                        ms(access.invoked - promise)
                    ),
                ));
                break;
            }
            if let Some(denied) = grant.denials.iter().find(|d| **d < access.invoked) {
                violations.push(Violation::during(
                    *denied,
                    access.invoked,
                    &[&hold.process],
                    format!(
                        "{} still found its guard (token {}) held {} after the server answered that it no longer held it",
                        hold.process,
                        hold.token,
                        ms(access.invoked - denied)
                    ),
                ));
                break;
            }
        }
    }

    // (b) Recovery after a holder vanished.
    let info = &facts.info;
    let lock_ops = history.ops(Kind::Lock);
    let mut slowest: Option<u64> = None;
    for fault in facts
        .faults
        .iter()
        .filter(|f| matches!(f.action.as_str(), "kill" | "pause"))
    {
        let Some(grant) = facts.grants.iter().find(|g| {
            g.process == fault.target && g.granted <= fault.start && fault.start < g.end()
        }) else {
            continue;
        };
        let base = match (grant.expiry, fault.action.as_str()) {
            (Expiry::Never, "kill") => fault.start,
            (Expiry::Never, _) => continue,
            _ => grant.promise(),
        };
        if fault.action == "pause" && fault.end <= base {
            continue; // resumed in time to keep its lease
        }
        let allowed = base + info.lock_delay_us + info.recovery_slack_us;
        // Other faults at the same time (a paused server) may rightly delay recovery.
        if facts
            .faults
            .iter()
            .any(|f| !std::ptr::eq(f, fault) && f.start < allowed && f.end > fault.start)
        {
            continue;
        }
        // The next grant to another worker, from the earliest moment the server may have
        // made it (its request's send, if after the fault): an answer that came late (its
        // worker paused, its link slow) says nothing of when the lock was free again.
        let next = facts
            .grants
            .iter()
            .filter(|g| {
                g.lock == grant.lock && g.process != grant.process && g.granted > fault.start
            })
            .map(|g| g.invoked.max(fault.start))
            .min();
        let waiting = lock_ops.iter().any(|op| {
            op.process() != fault.target
                && op.start() <= base
                && op.end().is_none_or(|end| end > base)
                && op.outcome() != Phase::Fail
        });
        match next {
            Some(at) if at <= allowed => {
                let took = at.saturating_sub(base);
                slowest = Some(slowest.map_or(took, |s| s.max(took)));
            }
            _ if !waiting => {}
            _ => violations.push(Violation::during(
                base,
                allowed,
                &[&fault.target],
                format!(
                    "after {} {} while holding token {}, nobody had the lock within {} of its lease ending",
                    fault.target,
                    if fault.action == "kill" { "was killed" } else { "was paused" },
                    grant.token,
                    ms(allowed - base)
                ),
            )),
        }
    }
    let measure = match slowest {
        Some(s) => format!("slowest recovery {} after the lease", ms(s)),
        None => "no recovery measured".into(),
    };
    Finding::measured(violations, measure)
        .unless_empty(facts, !held, "no worker held the lock")
        .breaking(broken)
}

#[cfg(test)]
mod tests {
    use super::super::{Check, Expect, Facts, Status, judge, run};
    use crate::history::{Event, Expiry, History, Kind, Phase};

    fn lock(w: &str, op: u64, owner: &str, token: u64, t0: u64, t1: u64) -> [Event; 2] {
        [
            Event::new(w, Kind::Lock, Phase::Invoke)
                .op(op)
                .lock("l")
                .at(t0),
            Event::new(w, Kind::Lock, Phase::Ok)
                .op(op)
                .owner(owner)
                .token(token)
                .at(t1),
        ]
    }

    fn write(w: &str, op: u64, owner: &str, t0: u64, t1: u64, held: bool) -> [Event; 2] {
        let mut done = Event::new(w, Kind::Write, Phase::Ok)
            .op(op)
            .answer("accepted")
            .at(t1);
        done.held = Some(held);
        [
            Event::new(w, Kind::Write, Phase::Invoke)
                .op(op)
                .owner(owner)
                .at(t0),
            done,
        ]
    }

    fn grant(
        w: &str,
        op: u64,
        owner: &str,
        token: u64,
        t0: u64,
        t1: u64,
        lease: u64,
    ) -> [Event; 2] {
        [
            Event::new(w, Kind::Acquire, Phase::Invoke)
                .op(op)
                .owner(owner)
                .lock("l")
                .at(t0),
            Event::new(w, Kind::Acquire, Phase::Ok)
                .op(op)
                .answer("granted")
                .token(token)
                .expiry(Expiry::After { us: lease })
                .at(t1),
        ]
    }

    fn findings(c: Check, events: Vec<Event>) -> usize {
        let h = History::from_events(events);
        run(c, &h, &Facts::new(&h)).violations.len()
    }

    /// w1 holds from 10 (lease 1000 from 0) and writes at 100 and 900.
    /// w2 has the lock at 1100 and writes at 1200.
    fn handover() -> Vec<Event> {
        let mut h: Vec<Event> = Vec::new();
        h.extend(grant("w1", 1, "a", 5, 0, 10, 1000));
        h.extend(lock("w1", 2, "a", 5, 0, 11));
        h.extend(write("w1", 3, "a", 100, 110, true));
        h.extend(write("w1", 4, "a", 900, 910, true));
        h.extend(grant("w2", 1, "b", 6, 1050, 1100, 1000));
        h.extend(lock("w2", 2, "b", 6, 1000, 1101));
        h.extend(write("w2", 3, "b", 1200, 1210, true));
        h
    }

    #[test]
    fn c6_passes_a_clean_handover_and_measures_an_overlap() {
        assert_eq!(findings(Check::C6, handover()), 0);
        let mut bad = handover();
        bad.extend(write("w1", 5, "a", 1300, 1310, true));
        assert_eq!(findings(Check::C6, bad), 1);
        // A stale worker that finds its guard lost does not count.
        let mut fine = handover();
        fine.extend(write("w1", 5, "a", 1300, 1310, false));
        assert_eq!(findings(Check::C6, fine), 0);
    }

    #[test]
    fn c9_fails_a_guard_held_past_its_lease_or_after_not_owner() {
        assert_eq!(findings(Check::C9, handover()), 0);
        // Found held at 1005, after the promise (0 + 1000).
        let mut overstay = handover();
        overstay.extend(write("w1", 5, "a", 1005, 1006, true));
        assert_eq!(findings(Check::C9, overstay), 1);
        // A renewal answered "lost" at 500; still held at 600.
        let mut denied: Vec<Event> = Vec::new();
        denied.extend(grant("w1", 1, "a", 5, 0, 10, 1000));
        denied.extend(lock("w1", 2, "a", 5, 0, 11));
        denied.push(
            Event::new("w1", Kind::Renew, Phase::Invoke)
                .op(3)
                .owner("a")
                .lock("l")
                .at(400),
        );
        denied.push(
            Event::new("w1", Kind::Renew, Phase::Ok)
                .op(3)
                .answer("lost")
                .at(500),
        );
        denied.extend(write("w1", 4, "a", 600, 610, true));
        assert_eq!(findings(Check::C9, denied), 1);
    }

    /// w1 is granted at 10 on session `s`, and writes at each of `writes`, finding its guard held.
    /// The session's backend reports each keep-alive as `(at, deadline the client counts
    /// on, server's bound)`.
    fn session_hold(keep_alives: &[(u64, u64, u64)], writes: &[u64]) -> Vec<Event> {
        // Built from JSON, as a recorded history is read.
        let session = |until: u64, server: u64| -> Expiry {
            serde_json::from_value(
                serde_json::json!({"session": {"until": until, "server_until": server}}),
            )
            .unwrap()
        };
        let id = serde_json::json!({"session": "s"});
        let mut h = vec![
            Event::new("w1", Kind::Acquire, Phase::Invoke)
                .op(1)
                .owner("a")
                .lock("l")
                .at(0),
            Event::new("w1", Kind::Acquire, Phase::Ok)
                .op(1)
                .answer("granted")
                .token(5)
                .expiry(session(990_000, 1_000_000))
                .value(id.clone())
                .at(10),
        ];
        h.extend(lock("w1", 2, "a", 5, 0, 11));
        for (at, until, server) in keep_alives {
            h.push(
                Event::new("w1", Kind::Session, Phase::Info)
                    .expiry(session(*until, *server))
                    .value(id.clone())
                    .at(*at),
            );
        }
        for (i, t) in writes.iter().enumerate() {
            h.extend(write("w1", 10 + i as u64, "a", *t, t + 10, true));
        }
        h
    }

    #[test]
    fn c9_holds_a_session_guard_against_the_servers_bound_not_the_clients_deadline() {
        // A keep-alive sent at 500 000, answered at 800 000: the server keeps the session
        // until at least 1 500 000. A correct backend counts on it until 1 490 000.
        let correct = session_hold(&[(800_000, 1_490_000, 1_500_000)], &[1_000_000, 1_480_000]);
        assert_eq!(findings(Check::C9, correct), 0);
        // A backend that counts from the reply (until 1 790 000) lets its guard be found
        // held at 1 600 000: after the server could have ended the session.
        let from_reply = session_hold(&[(800_000, 1_790_000, 1_500_000)], &[1_000_000, 1_600_000]);
        assert_eq!(findings(Check::C9, from_reply), 1);
    }

    #[test]
    fn c9_fails_a_session_grant_whose_backend_does_not_say_when_the_server_may_end_it() {
        let mut h = session_hold(&[], &[100_000]);
        h[1].expiry = Some(Expiry::Session {
            until: 990_000,
            server_until: None,
        });
        let history = History::from_events(h);
        let verdict = judge(
            Check::C9,
            run(Check::C9, &history, &Facts::new(&history)),
            Expect::Hold,
        );
        assert_eq!(verdict.status, Status::Fail, "{}", verdict.summary);
        assert!(verdict.summary.contains("server"), "{}", verdict.summary);
    }

    #[test]
    fn c9_fails_a_lock_not_recovered_after_its_holder_was_killed() {
        let kill = |t| {
            let mut e = Event::new("nemesis", Kind::Fault, Phase::Invoke)
                .op(1)
                .at(t);
            e.fault = Some("kill".into());
            e.target = Some("w1".into());
            e
        };
        let mut h: Vec<Event> = Vec::new();
        h.extend(grant("w1", 1, "a", 5, 0, 10, 1_000));
        h.push(kill(100));
        h.push(
            Event::new("w2", Kind::Lock, Phase::Invoke)
                .op(1)
                .lock("l")
                .at(50),
        );
        let mut recovered = h.clone();
        recovered.extend(grant("w2", 2, "b", 6, 1_100, 1_200, 1_000));
        assert_eq!(findings(Check::C9, recovered), 0);
        // The default slack is 1.5 s: granted 3 s after the lease ended is too late.
        let mut late = h.clone();
        late.extend(grant("w2", 2, "b", 6, 4_000_000, 4_000_100, 1_000));
        assert_eq!(findings(Check::C9, late), 1);
        // Granted in time, but the answer came 3 s later: the lock was free again in time.
        let mut answered_late = h;
        answered_late.extend(grant("w2", 2, "b", 6, 1_100, 3_001_100, 1_000));
        assert_eq!(findings(Check::C9, answered_late), 0);
    }
}
