//! The server side: C3, C5, C8 and C10.
//! C3 (token order), C5 (double grants), C8 (release safety), C10 (nothing left behind).

use serde_json::Value;

use super::{Facts, Finding, Record, Violation, ms};
use crate::history::{History, Kind, Phase};

/// C3: every grant's token is its own, and tokens follow the grants' real-time order.
/// Two owners never share one, and a grant answered before another was asked has the lower
/// token.
pub(super) fn c3_token_order(facts: &Facts) -> Finding {
    let incomplete = facts.incomplete(Record::Grant);
    if facts.grants.is_empty() && incomplete.is_empty() {
        return Finding::nothing(facts, "no grant");
    }
    let mut violations = Vec::new();
    for grants in facts.grants_by_lock().values() {
        let mut seen: std::collections::HashMap<u64, &str> = Default::default();
        for g in grants {
            if let Some(other) = seen.insert(g.token, &g.owner)
                && other != g.owner
            {
                violations.push(Violation::at(
                    g.granted,
                    &[&g.process],
                    format!("token {} granted to two owners", g.token),
                ));
            }
        }
        let mut by_answer: Vec<_> = grants.iter().map(|g| (g.granted, g.token, g)).collect();
        by_answer.sort_by_key(|x| (x.0, x.1));
        for g in grants {
            let earlier = by_answer
                .iter()
                .filter(|(granted, _, o)| *granted < g.invoked && o.owner != g.owner)
                .max_by_key(|(_, token, _)| *token);
            if let Some((_, token, o)) = earlier
                && *token >= g.token
            {
                violations.push(Violation::at(
                    g.granted,
                    &[&g.process, &o.process],
                    format!(
                        "{} was granted token {} after {} had been granted {token}",
                        g.process, g.token, o.process
                    ),
                ));
            }
        }
    }
    Finding::measured(violations, format!("{} grants", facts.grants.len())).breaking(incomplete)
}

/// C5: by the server's own promises, no two owners held the lock at once.
/// A grant of lease `d` asked at `i` is kept until at least `i + d` unless released; a
/// session grant until the session's deadline, or the server's bound if earlier. Also: no
/// inspect showed two exclusive holders.
pub(super) fn c5_double_grant(history: &History, facts: &Facts) -> Finding {
    let incomplete = facts.incomplete(Record::Grant);
    let mut violations = Vec::new();
    let mut longest = 0u64;
    for grants in facts.grants_by_lock().values() {
        for (i, a) in grants.iter().enumerate() {
            for b in &grants[i + 1..] {
                if a.owner == b.owner {
                    continue;
                }
                let from = a.granted.max(b.granted);
                let to = a.end().min(b.end());
                if from < to {
                    let (first, second) = if a.granted <= b.granted {
                        (a, b)
                    } else {
                        (b, a)
                    };
                    longest = longest.max(to.saturating_sub(from));
                    violations.push(Violation::during(
                        from,
                        to,
                        &[&first.process, &second.process],
                        format!(
                            "{} (token {}) was granted while {} (token {}) held by the server's promise until {}",
                            second.process,
                            second.token,
                            first.process,
                            first.token,
                            if first.end() == u64::MAX { "its release".into() } else { format!("t={}", ms(first.end())) }
                        ),
                    ));
                }
            }
        }
    }
    // A holder whose process was killed before the look is a leftover of the dead (a
    // record not yet cleaned up), not a second grant.
    let dead = |owner: Option<&str>, t: u64| {
        facts
            .grants
            .iter()
            .filter(|g| Some(g.owner.as_str()) == owner)
            .any(|g| {
                facts.faults.iter().any(|f| {
                    f.action == "kill"
                        && f.target == g.process
                        && g.granted <= f.start
                        && f.start <= t
                })
            })
    };
    for e in history.of(Kind::Inspect) {
        let exclusive: Vec<&Value> = e
            .value
            .as_ref()
            .and_then(|v| v.get("holders"))
            .and_then(Value::as_array)
            .map(|hs| {
                hs.iter()
                    .filter(|h| h.get("mode").and_then(Value::as_str) == Some("exclusive"))
                    .filter(|h| !dead(h.get("owner").and_then(Value::as_str), e.t))
                    .collect()
            })
            .unwrap_or_default();
        if exclusive.len() > 1 {
            violations.push(Violation::at(
                e.t,
                &[&e.process],
                format!(
                    "the server reported {} exclusive holders at once",
                    exclusive.len()
                ),
            ));
        }
    }
    let n = violations.len();
    Finding::measured(
        violations,
        if n == 0 {
            format!("{} grants, none overlapping", facts.grants.len())
        } else {
            format!("{n} double grant(s), longest {}", ms(longest))
        },
    )
    .unless_empty(
        facts,
        facts.grants.is_empty() && incomplete.is_empty(),
        "no grant",
    )
    .breaking(incomplete)
}

/// C8: a release answered "released" only for an owner id its own process acquired.
/// And only while no other owner had been granted the lock since that owner's last grant or
/// renewal: otherwise it removed someone else's lock. "Since" means certainly applied after
/// it by the server (asked for after it was answered, or with a higher token where tokens
/// follow the order of grants), not merely answered after it.
pub(super) fn c8_release_safety(history: &History, facts: &Facts) -> Finding {
    let releases = history.ops(Kind::Release);
    if releases.is_empty() {
        return Finding::nothing(facts, "no release");
    }
    let acquires = history.ops(Kind::Acquire);
    let mut violations = Vec::new();
    let mut foreign_refused = 0;
    for op in &releases {
        let owner = op.owner().unwrap_or("");
        let lock = op.invoke.lock.as_deref().unwrap_or("");
        let mine = facts.owner_process.get(owner).map(String::as_str) == Some(op.process());
        if !op.answered("released") {
            if !mine && op.outcome() == Phase::Ok {
                foreign_refused += 1;
            }
            continue;
        }
        if !mine {
            let whose = facts
                .owner_process
                .get(owner)
                .map_or("nobody's".into(), |p| format!("{p}'s"));
            violations.push(Violation::at(
                op.start(),
                &[op.process()],
                format!("{} released {whose} grant (owner {owner})", op.process()),
            ));
            continue;
        }
        // Never granted: what it released was its place in the queue.
        let Some(grant) = facts.grant_at(lock, owner, op.start()) else {
            continue;
        };
        let last_own = grant
            .extensions
            .iter()
            .map(|e| e.1)
            .filter(|t| *t < op.start())
            .max()
            .unwrap_or(grant.granted);
        // A grant is newer only if the server certainly applied it after that last
        // extension and before this release: answered before the release was asked, and
        // asked after the extension was answered — or, with one copy of each lock (its
        // tokens follow the order of grants: C3), carrying a higher token. Its answer
        // alone says nothing: an answer read late (its process paused) may announce a
        // grant older than the releasing owner's.
        let newer = facts.grants.iter().find(|g| {
            g.lock == grant.lock
                && g.owner != grant.owner
                && g.granted < op.start()
                && (g.invoked > last_own
                    || (facts.info.copies == 1 && g.token > grant.token && g.granted > last_own))
        });
        // After its last grant the owner may have queued again (the release then removed
        // its place in the queue), an acquire of it without an answer may have landed late
        // and granted it again, and on a backend with several copies of each lock the
        // release may have removed only its own stale copies.
        let requeued = |after: u64| {
            acquires.iter().any(|a| {
                a.owner() == Some(owner) && (a.start() > after || a.outcome() == Phase::Unknown)
            })
        };
        if let Some(newer) = newer
            && facts.info.copies == 1
            && !requeued(last_own)
        {
            violations.push(Violation::at(
                op.start(),
                &[op.process(), &newer.process],
                format!(
                    "{} released (token {}) after {} had been granted token {}: it removed the newer holder's lock",
                    op.process(),
                    grant.token,
                    newer.process,
                    newer.token
                ),
            ));
        }
    }
    Finding::measured(
        violations,
        format!(
            "{} releases, {foreign_refused} releases of other owners refused",
            releases.len()
        ),
    )
}

/// C10: every unknown outcome was resolved, and the server is left empty.
/// Every acquire whose outcome was unknown was resolved by its owner (adopted by a later
/// grant, or released), unless its process was killed; and after the run the server shows
/// no holder and no waiter.
pub(super) fn c10_nothing_left(history: &History, facts: &Facts) -> Finding {
    let mut violations = Vec::new();
    let acquires = history.ops(Kind::Acquire);
    let releases = history.ops(Kind::Release);
    let mut unknown = 0;
    for op in acquires.iter().filter(|op| op.outcome() == Phase::Unknown) {
        unknown += 1;
        let owner = op.owner().unwrap_or("");
        let process = op.process();
        let adopted = acquires.iter().any(|o| {
            o.process() == process
                && o.owner() == Some(owner)
                && o.start() > op.start()
                && o.answered("granted")
        });
        let released = releases
            .iter()
            .any(|r| r.process() == process && r.owner() == Some(owner) && r.start() > op.start());
        let killed = facts
            .faults
            .iter()
            .any(|f| f.action == "kill" && f.target == process && f.start > op.start());
        if !(adopted || released || killed) {
            violations.push(Violation::at(
                op.start(),
                &[process],
                format!(
                    "{process}'s acquire (owner {owner}) had an unknown outcome and was neither adopted nor released"
                ),
            ));
        }
    }
    let last = history
        .of(Kind::Inspect)
        .rfind(|e| e.value.as_ref().and_then(|v| v.get("final")) == Some(&Value::Bool(true)));
    let Some(e) = last else {
        return Finding {
            violations,
            ..Finding::nothing(facts, "no final inspection of the server")
        };
    };
    let v = e.value.as_ref().unwrap_or(&Value::Null);
    let holders = v.get("holders").and_then(Value::as_array).map(Vec::len);
    let waiters = v.get("waiters").and_then(Value::as_u64);
    let (Some(holders), Some(waiters)) = (holders, waiters) else {
        return Finding {
            violations,
            ..Finding::default()
        }
        .breaking([Violation::at(
            e.t,
            &[&e.process],
            "the final inspection does not say how many holders and waiters there were",
        )]);
    };
    if holders + waiters as usize > 0 {
        violations.push(Violation::at(
            e.t,
            &[&e.process],
            format!(
                "after the run the server still shows {holders} holder(s) and {waiters} waiter(s)"
            ),
        ));
    }
    Finding::measured(
        violations,
        format!("{unknown} acquires with unknown outcome"),
    )
}

#[cfg(test)]
mod tests {
    use super::super::{Check, Facts, run};
    use crate::history::{Event, Expiry, History, Kind, Phase};
    use serde_json::json;

    /// A backend call by `w` for owner `o`, invoked at `t0`, answered at `t1`.
    pub(crate) fn call(
        kind: Kind,
        w: &str,
        op: u64,
        o: &str,
        t0: u64,
        t1: u64,
        answer: &str,
    ) -> [Event; 2] {
        [
            Event::new(w, kind, Phase::Invoke)
                .op(op)
                .owner(o)
                .lock("l")
                .at(t0),
            Event::new(w, kind, Phase::Ok).op(op).answer(answer).at(t1),
        ]
    }

    pub(crate) fn grant(
        w: &str,
        op: u64,
        o: &str,
        t0: u64,
        t1: u64,
        token: u64,
        lease: u64,
    ) -> [Event; 2] {
        let [i, mut d] = call(Kind::Acquire, w, op, o, t0, t1, "granted");
        d.token = Some(token);
        d.expiry = Some(Expiry::After { us: lease });
        [i, d]
    }

    fn findings(c: Check, events: Vec<Event>) -> usize {
        let h = History::from_events(events);
        run(c, &h, &Facts::new(&h)).violations.len()
    }

    #[test]
    fn c3_passes_increasing_tokens_and_fails_reuse_or_regression() {
        let mut good: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        good.extend(grant("w2", 1, "b", 2000, 2010, 6, 1000));
        // Concurrent grants may come in either order.
        good.extend(grant("w3", 1, "c", 1990, 2020, 7, 1000));
        assert_eq!(findings(Check::C3, good), 0);
        let mut back: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        back.extend(grant("w2", 1, "b", 2000, 2010, 4, 1000));
        assert_eq!(findings(Check::C3, back), 1);
        let mut shared: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        shared.extend(grant("w2", 1, "b", 2000, 2010, 5, 1000));
        assert!(findings(Check::C3, shared) >= 1);
    }

    #[test]
    fn c5_passes_a_grant_after_the_promise_and_fails_one_inside_it() {
        // a: asked at 0 for 1000 µs: promised until 1000.
        let mut good: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        good.extend(grant("w2", 1, "b", 900, 1001, 6, 1000));
        assert_eq!(findings(Check::C5, good), 0);
        let mut bad: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        bad.extend(grant("w2", 1, "b", 500, 600, 6, 1000));
        assert_eq!(findings(Check::C5, bad), 1);
        // A renewal extends the promise; a release ends it.
        let mut renewed: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        let [i, mut d] = call(Kind::Renew, "w1", 2, "a", 800, 810, "renewed");
        d.expiry = Some(Expiry::After { us: 1000 });
        renewed.extend([i, d]);
        renewed.extend(grant("w2", 1, "b", 1500, 1600, 6, 1000));
        assert_eq!(findings(Check::C5, renewed.clone()), 1);
        let mut released = renewed;
        released.extend(call(Kind::Release, "w1", 3, "a", 1400, 1410, "released"));
        assert_eq!(findings(Check::C5, released), 0);
        // The server showing two exclusive holders.
        let inspect = Event::new("observer", Kind::Inspect, Phase::Info).value(json!({
            "holders": [{"owner": "a", "mode": "exclusive"}, {"owner": "b", "mode": "exclusive"}]
        }));
        assert_eq!(findings(Check::C5, vec![inspect]), 1);
    }

    #[test]
    fn a_grant_given_back_and_a_later_one_under_the_same_owner_are_two_grants() {
        // a is granted token 5 too late and gives it back; b holds; a's acquisition goes
        // on under the same owner id and is granted token 7 after b released.
        let mut h: Vec<Event> = grant("w1", 1, "a", 0, 900, 5, 1000).into();
        h.extend(call(Kind::Release, "w1", 2, "a", 910, 920, "released"));
        h.extend(grant("w2", 1, "b", 950, 960, 6, 1000));
        h.extend(call(Kind::Release, "w2", 2, "b", 1500, 1510, "released"));
        h.extend(grant("w1", 3, "a", 1600, 1610, 7, 1000));
        h.extend(call(Kind::Release, "w1", 4, "a", 1700, 1710, "released"));
        for c in [Check::C3, Check::C5, Check::C8] {
            assert_eq!(findings(c, h.clone()), 0, "{c}");
        }
        let facts = Facts::new(&History::from_events(h));
        assert_eq!(facts.grants.len(), 3);
        assert_eq!(facts.grants[0].cut, 910);
        assert_eq!(facts.grants[2].token, 7);
    }

    #[test]
    fn a_grant_forgotten_early_then_given_up_frees_the_lock() {
        // Redlock after a majority restarted empty: the renewal says lost, the release
        // removes the last copy; a grant after that is no double grant. Before it, it is.
        let mut h: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 2000).into();
        h.extend(call(Kind::Renew, "w1", 2, "a", 600, 700, "lost"));
        h.extend(call(Kind::Release, "w1", 3, "a", 800, 900, "released"));
        let mut after = h.clone();
        after.extend(grant("w2", 1, "b", 1000, 1100, 6, 2000));
        assert_eq!(findings(Check::C5, after.clone()), 0);
        assert_eq!(findings(Check::C7, after), 0);
        let mut before: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 2000).into();
        before.extend(call(Kind::Renew, "w1", 2, "a", 600, 700, "lost"));
        before.extend(grant("w2", 1, "b", 710, 750, 6, 2000));
        before.extend(call(Kind::Release, "w1", 3, "a", 800, 900, "released"));
        assert_eq!(findings(Check::C5, before.clone()), 1);
        assert_eq!(findings(Check::C7, before), 1);
    }

    #[test]
    fn a_release_of_a_place_in_the_queue_after_a_given_back_grant_is_no_violation() {
        // a's grant came too late and was given back (not held by then); a queued again
        // under the same owner id; b was granted; a's release removed a's queue entry.
        let mut h: Vec<Event> = grant("w1", 1, "a", 0, 1500, 5, 1000).into();
        h.extend(call(Kind::Release, "w1", 2, "a", 1500, 2600, "not_held"));
        h.extend(call(Kind::Acquire, "w1", 3, "a", 2700, 2710, "busy"));
        h.extend(grant("w2", 1, "b", 3000, 3010, 6, 1000));
        h.extend(call(Kind::Release, "w1", 4, "a", 3020, 3030, "released"));
        assert_eq!(findings(Check::C8, h.clone()), 0);
        assert_eq!(findings(Check::C7, h), 0);
    }

    #[test]
    fn c8_fails_a_release_of_another_owner_or_after_being_superseded() {
        let mut good: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        good.extend(call(Kind::Release, "w1", 2, "a", 100, 110, "released"));
        // A stale release after being superseded, refused: fine.
        good.extend(grant("w2", 1, "b", 200, 210, 6, 1000));
        good.extend(call(Kind::Release, "w1", 3, "a", 300, 310, "not_held"));
        assert_eq!(findings(Check::C8, good.clone()), 0);
        let mut foreign = good.clone();
        foreign.extend(call(Kind::Release, "w1", 4, "b", 400, 410, "released"));
        assert_eq!(findings(Check::C8, foreign), 1);
        let mut superseded: Vec<Event> = grant("w1", 1, "a", 0, 10, 5, 1000).into();
        superseded.extend(grant("w2", 1, "b", 2000, 2010, 6, 1000));
        superseded.extend(call(Kind::Release, "w1", 2, "a", 2100, 2110, "released"));
        assert_eq!(findings(Check::C8, superseded), 1);
    }

    /// The shape of a CI failure (postgres, expire-while-queued, seed 1, under load).
    /// The server granted w2 token 1, the very first grant, and w2 was paused before it
    /// read the answer; w1 was granted token 5 later; w2's answer came after its resume,
    /// between w1's grant and w1's release. The answer was late, the grant was not new.
    fn late_answered_first_grant() -> Vec<Event> {
        let mut h: Vec<Event> = grant("w2", 1, "b", 0, 2_493_000, 1, 1_000_000).into();
        // The others are granted once w2's lease has run out on the server.
        h.extend(grant("w3", 1, "c", 1_050_000, 1_060_000, 2, 1_000_000));
        h.extend(call(
            Kind::Release,
            "w3",
            2,
            "c",
            1_300_000,
            1_310_000,
            "released",
        ));
        h.extend(grant("w3", 3, "c2", 1_350_000, 1_360_000, 3, 1_000_000));
        h.extend(call(
            Kind::Release,
            "w3",
            4,
            "c2",
            1_600_000,
            1_610_000,
            "released",
        ));
        h.extend(grant("w1", 1, "a0", 1_650_000, 1_660_000, 4, 1_000_000));
        h.extend(call(
            Kind::Release,
            "w1",
            2,
            "a0",
            2_000_000,
            2_010_000,
            "released",
        ));
        h.extend(grant("w1", 3, "a", 2_400_000, 2_409_000, 5, 1_000_000));
        // w2 gives back the grant it learnt of too late: it had expired.
        h.extend(call(
            Kind::Release,
            "w2",
            2,
            "b",
            2_493_010,
            2_501_000,
            "not_held",
        ));
        h.extend(call(
            Kind::Release,
            "w1",
            4,
            "a",
            2_600_000,
            2_610_000,
            "released",
        ));
        h
    }

    #[test]
    fn c8_does_not_take_an_old_grant_answered_late_for_a_newer_one() {
        let h = late_answered_first_grant();
        for c in [Check::C3, Check::C5, Check::C7, Check::C8] {
            assert_eq!(findings(c, h.clone()), 0, "{c}");
        }
        // A grant asked for after w1's was answered is newer, whenever its answer came.
        let mut newer = late_answered_first_grant();
        newer.extend(grant("w3", 5, "c3", 2_420_000, 2_430_000, 6, 1_000_000));
        assert_eq!(findings(Check::C8, newer), 1);
        // So is one with a higher token (one copy of each lock: tokens follow grant order),
        // asked for before but answered after w1's grant.
        let mut higher = late_answered_first_grant();
        higher.extend(grant("w3", 5, "c3", 2_300_000, 2_420_000, 6, 1_000_000));
        assert_eq!(findings(Check::C8, higher), 1);
    }

    #[test]
    fn c10_fails_an_unresolved_unknown_acquire_and_leftovers() {
        let unknown = |w: &str, op, o: &str, t| {
            Event::new(w, Kind::Acquire, Phase::Invoke)
                .op(op)
                .owner(o)
                .lock("l")
                .at(t)
        };
        let fin = |holders: serde_json::Value| {
            Event::new("observer", Kind::Inspect, Phase::Info)
                .value(json!({"holders": holders, "waiters": 0, "final": true}))
                .at(10_000)
        };
        // Adopted by a retry with the same owner.
        let mut adopted = vec![
            unknown("w1", 1, "a", 0),
            Event::new("w1", Kind::Acquire, Phase::Unknown)
                .op(1)
                .at(100),
        ];
        adopted.extend(grant("w1", 2, "a", 200, 210, 5, 1000));
        adopted.push(fin(json!([])));
        assert_eq!(findings(Check::C10, adopted), 0);
        // Released when the acquisition gave up.
        let mut released = vec![unknown("w1", 1, "a", 0)];
        released.extend(call(Kind::Release, "w1", 2, "a", 200, 210, "released"));
        assert_eq!(findings(Check::C10, released), 0);
        // A retry under a new owner id leaves the first grant orphaned.
        let mut orphaned = vec![unknown("w1", 1, "a", 0)];
        orphaned.extend(grant("w1", 2, "a2", 200, 210, 5, 1000));
        orphaned.extend(call(Kind::Release, "w1", 3, "a2", 300, 310, "released"));
        assert_eq!(findings(Check::C10, orphaned), 1);
        // Something left on the server.
        assert_eq!(findings(Check::C10, vec![fin(json!([{"owner": "a"}]))]), 1);
    }
}
