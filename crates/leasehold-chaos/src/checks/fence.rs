//! The resource side: C1 (fence order), C2 (stale accesses), C4 (lost writes).

use std::collections::HashMap;

use serde_json::Value;

use super::{Facts, Finding, Violation};
use crate::history::{Event, History, Kind, Op};

/// The resource's own log: applied (or refused) accesses in the order it handled them.
fn applied(history: &History) -> Vec<&Event> {
    let mut log: Vec<&Event> = history
        .of(Kind::Apply)
        .filter(|e| e.process == "resource")
        .collect();
    // One connection carries them, so arrival order is the order of application.
    log.sort_by_key(|e| e.seq);
    log
}

/// C1: in the order the resource applied them, accepted tokens never decrease.
/// And a token is only ever presented by one owner (the fence accepts equal tokens, so a
/// token shared by two owners would let both through).
pub(super) fn c1_fence_order(history: &History, facts: &Facts) -> Finding {
    let log = applied(history);
    if log.is_empty() {
        return Finding::nothing(facts, "the resource applied no access");
    }
    let mut violations = Vec::new();
    let mut broken = Vec::new();
    let mut highest: Option<(u64, &str)> = None;
    let mut owners: HashMap<u64, &str> = HashMap::new();
    let mut accepted = 0;
    for e in log {
        if e.answer.as_deref() != Some("accepted") {
            continue;
        }
        accepted += 1;
        let worker = e.worker.as_deref().unwrap_or("?");
        let (Some(token), Some(owner)) = (e.token, e.owner.as_deref()) else {
            broken.push(Violation::at(
                e.t,
                &[worker],
                format!(
                    "the resource accepted an access of {worker} without {}",
                    if e.token.is_none() {
                        "a token"
                    } else {
                        "an owner"
                    }
                ),
            ));
            continue;
        };
        if let Some((top, top_worker)) = highest
            && token < top
        {
            violations.push(Violation::at(
                e.t,
                &[worker, top_worker],
                format!("token {token} of {worker} accepted after token {top} of {top_worker}"),
            ));
        }
        match owners.get(&token) {
            Some(first) if *first != owner => violations.push(Violation::at(
                e.t,
                &[worker],
                format!("token {token} presented by two owners ({first}, {owner})"),
            )),
            Some(_) => {}
            None => {
                owners.insert(token, owner);
            }
        }
        if highest.is_none_or(|(top, _)| token >= top) {
            highest = Some((token, worker));
        }
    }
    Finding::measured(violations, format!("{accepted} accesses accepted")).breaking(broken)
}

/// C2: no access is accepted after an access with a higher token was acknowledged.
/// No access (read or write) is acknowledged as accepted when an access with a higher token
/// had been acknowledged before it was invoked: the writer had been superseded, and its
/// access was stale. Also counts the stale accesses the fence refused.
pub(super) fn c2_stale_access(history: &History, facts: &Facts) -> Finding {
    let mut ops = history.ops(Kind::Read);
    ops.extend(history.ops(Kind::Write));
    if ops.is_empty() {
        return Finding::nothing(facts, "no read or write");
    }
    let (acknowledged, incomplete): (Vec<&Op<'_>>, Vec<&Op<'_>>) = ops
        .iter()
        .filter(|op| op.answered("accepted"))
        .partition(|op| op.token().is_some() && op.owner().is_some());
    let broken = incomplete.iter().map(|op| {
        Violation::at(
            op.start(),
            &[op.process()],
            format!(
                "an access of {} was accepted without {}",
                op.process(),
                if op.token().is_none() {
                    "a token"
                } else {
                    "an owner"
                }
            ),
        )
    });
    let refused = ops
        .iter()
        .filter(|op| op.answer() == Some("refused"))
        .count();
    // (answer time, token, process), by answer time, with the highest token so far.
    let mut by_end: Vec<(u64, u64, &str)> = acknowledged
        .iter()
        .filter_map(|op| Some((op.end()?, op.token()?, op.process())))
        .collect();
    by_end.sort_unstable();
    let mut prefix_max: Vec<(u64, &str)> = Vec::with_capacity(by_end.len());
    for &(_, token, process) in &by_end {
        let best = match prefix_max.last() {
            Some(&(top, p)) if top >= token => (top, p),
            _ => (token, process),
        };
        prefix_max.push(best);
    }
    let mut violations = Vec::new();
    for op in &acknowledged {
        let token = op.token().unwrap_or(0);
        let before = by_end.partition_point(|&(end, _, _)| end < op.start());
        if before == 0 {
            continue;
        }
        let (top, by) = prefix_max[before - 1];
        if top > token {
            let what = if op.invoke.kind == Some(Kind::Read) {
                "read"
            } else {
                "write"
            };
            violations.push(Violation::at(
                op.start(),
                &[op.process(), by],
                format!(
                    "stale {what} of {} with token {token} accepted after token {top} of {by} was",
                    op.process()
                ),
            ));
        }
    }
    Finding::measured(
        violations,
        format!(
            "{} accesses acknowledged, {refused} stale accesses refused by the fence",
            acknowledged.len()
        ),
    )
    .breaking(broken)
}

/// C4: every acknowledged write is in the final state.
/// Counter: each write the resource accepted must have incremented what was there
/// (otherwise it overwrote an increment it never read). Set: every acknowledged write's
/// element is in the final set.
pub(super) fn c4_lost_writes(history: &History, facts: &Facts) -> Finding {
    let Some(last) = history.of(Kind::Final).rfind(|e| e.process == "resource") else {
        return Finding::nothing(facts, "the resource reported no final state");
    };
    let final_value = last.value.clone().unwrap_or(Value::Null);
    let workload = final_value
        .get("workload")
        .and_then(Value::as_str)
        .unwrap_or("counter")
        .to_owned();
    let state = final_value.get("value").cloned().unwrap_or(Value::Null);
    let mut violations = Vec::new();
    let writes = history.ops(Kind::Write);
    let acknowledged: Vec<_> = writes.iter().filter(|w| w.answered("accepted")).collect();
    // Each acknowledged write must have been applied by the resource.
    let applied_ok: std::collections::HashSet<(&str, u64)> = applied(history)
        .into_iter()
        .filter(|e| e.answer.as_deref() == Some("accepted") && e.target.as_deref() == Some("write"))
        .map(|e| (e.worker.as_deref().unwrap_or(""), e.op))
        .collect();
    for w in &acknowledged {
        if !applied_ok.contains(&(w.process(), w.invoke.op)) {
            violations.push(Violation::at(
                w.end().unwrap_or(w.start()),
                &[w.process()],
                format!(
                    "write {} of {} acknowledged but not applied",
                    w.invoke.op,
                    w.process()
                ),
            ));
        }
    }
    match workload.as_str() {
        "counter" => {
            let mut last_after = Value::from(0);
            for e in applied(history) {
                if e.answer.as_deref() != Some("accepted") || e.target.as_deref() != Some("write") {
                    continue;
                }
                let prev = e.prev.as_ref().and_then(Value::as_i64).unwrap_or(0);
                let after = e.value.as_ref().and_then(Value::as_i64).unwrap_or(0);
                if after != prev + 1 {
                    let worker = e.worker.as_deref().unwrap_or("?");
                    violations.push(Violation::at(
                        e.t,
                        &[worker],
                        format!(
                            "{worker} wrote {after} over {prev}: {} acknowledged increment(s) lost",
                            (prev + 1 - after).max(1)
                        ),
                    ));
                }
                last_after = Value::from(after);
            }
            if state != last_after {
                violations.push(Violation::at(
                    last.t,
                    &["resource"],
                    format!("final counter {state} is not the last value written ({last_after})"),
                ));
            }
            Finding::measured(
                violations,
                format!(
                    "{} acknowledged writes, final counter {state}",
                    acknowledged.len()
                ),
            )
        }
        "set" => {
            let members: std::collections::HashSet<String> = state
                .as_array()
                .map(|a| a.iter().map(Value::to_string).collect())
                .unwrap_or_default();
            for w in &acknowledged {
                let Some(element) = w
                    .invoke
                    .value
                    .as_ref()
                    .and_then(Value::as_array)
                    .and_then(|a| a.last())
                else {
                    continue;
                };
                if !members.contains(&element.to_string()) {
                    violations.push(Violation::at(
                        w.end().unwrap_or(w.start()),
                        &[w.process()],
                        format!("element {element} of {} acknowledged but lost", w.process()),
                    ));
                }
            }
            Finding::measured(
                violations,
                format!(
                    "{} acknowledged appends, {} elements in the final set",
                    acknowledged.len(),
                    members.len()
                ),
            )
        }
        other => Finding::default().breaking([Violation::at(
            last.t,
            &["resource"],
            format!("the resource reported an unknown workload {other:?}"),
        )]),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Check, Facts, run};
    use crate::history::{Event, History, Kind, Phase};
    use serde_json::json;

    fn apply(worker: &str, op: u64, token: u64, accepted: bool, prev: i64, after: i64) -> Event {
        let mut e = Event::new("resource", Kind::Apply, Phase::Info)
            .op(op)
            .owner(format!("{worker}-o{token}"))
            .token(token)
            .answer(if accepted { "accepted" } else { "refused" })
            .value(json!(after));
        e.prev = Some(json!(prev));
        e.worker = Some(worker.into());
        e.target = Some("write".into());
        e
    }

    fn access(
        kind: Kind,
        w: &str,
        op: u64,
        token: u64,
        t0: u64,
        t1: u64,
        answer: &str,
    ) -> [Event; 2] {
        let mut done = Event::new(w, kind, Phase::Ok).op(op).answer(answer).at(t1);
        done.held = Some(true);
        [
            Event::new(w, kind, Phase::Invoke)
                .op(op)
                .token(token)
                .owner(format!("{w}-o{token}"))
                .value(json!(1))
                .at(t0),
            done,
        ]
    }

    fn final_counter(v: i64) -> Event {
        Event::new("resource", Kind::Final, Phase::Info)
            .value(json!({"workload": "counter", "value": v}))
            .at(1_000)
    }

    fn check(c: Check, events: Vec<Event>) -> usize {
        let h = History::from_events(events);
        let finding = run(c, &h, &Facts::new(&h));
        finding.violations.len()
    }

    #[test]
    fn c1_passes_increasing_tokens_and_fails_a_token_going_back() {
        let good = vec![
            apply("w1", 1, 3, true, 0, 1),
            apply("w1", 2, 3, true, 1, 2),
            apply("w2", 1, 5, true, 2, 3),
            apply("w1", 3, 3, false, 3, 3),
        ];
        assert_eq!(check(Check::C1, good), 0);
        let bad = vec![apply("w2", 1, 5, true, 0, 1), apply("w1", 1, 3, true, 1, 2)];
        assert_eq!(check(Check::C1, bad), 1);
        // One token, two owners.
        let mut shared = apply("w2", 1, 3, true, 1, 2);
        shared.owner = Some("someone-else".into());
        assert_eq!(
            check(Check::C1, vec![apply("w1", 1, 3, true, 0, 1), shared]),
            1
        );
    }

    #[test]
    fn c2_fails_an_access_acknowledged_after_a_higher_token_was() {
        let mut good = Vec::new();
        good.extend(access(Kind::Write, "w1", 1, 3, 10, 20, "accepted"));
        good.extend(access(Kind::Write, "w2", 1, 5, 30, 40, "accepted"));
        good.extend(access(Kind::Write, "w1", 2, 3, 50, 60, "refused"));
        // Concurrent with the higher one: not stale by what was acknowledged.
        good.extend(access(Kind::Write, "w1", 3, 3, 35, 45, "accepted"));
        assert_eq!(check(Check::C2, good), 0);
        let mut bad = Vec::new();
        bad.extend(access(Kind::Read, "w2", 1, 5, 30, 40, "accepted"));
        bad.extend(access(Kind::Write, "w1", 2, 3, 50, 60, "accepted"));
        assert_eq!(check(Check::C2, bad), 1);
    }

    #[test]
    fn c4_finds_an_increment_written_over_one_it_never_read() {
        let mut good: Vec<Event> = Vec::new();
        good.extend(access(Kind::Write, "w1", 1, 3, 10, 20, "accepted"));
        good.push(apply("w1", 1, 3, true, 0, 1).at(15));
        good.extend(access(Kind::Write, "w2", 1, 5, 30, 40, "accepted"));
        good.push(apply("w2", 1, 5, true, 1, 2).at(35));
        good.push(final_counter(2));
        assert_eq!(check(Check::C4, good.clone()), 0);
        // Observe mode under a double grant: both read 1 and wrote 2.
        let mut bad = good;
        bad.pop();
        bad.extend(access(Kind::Write, "w1", 2, 3, 50, 60, "accepted"));
        bad.push(apply("w1", 2, 3, true, 2, 2).at(55));
        bad.push(final_counter(2));
        assert_eq!(check(Check::C4, bad), 1);
        // Acknowledged but never applied.
        let mut ghost: Vec<Event> = access(Kind::Write, "w1", 1, 3, 10, 20, "accepted").into();
        ghost.push(final_counter(0));
        assert_eq!(check(Check::C4, ghost), 1);
    }

    #[test]
    fn c4_finds_an_acknowledged_element_missing_from_the_final_set() {
        let mut w = access(Kind::Write, "w1", 1, 3, 10, 20, "accepted");
        w[0].value = Some(json!(["w1-1"]));
        let mut a = apply("w1", 1, 3, true, 0, 0).at(15);
        a.value = Some(json!(["w1-1"]));
        a.prev = Some(json!([]));
        let set = |v| {
            Event::new("resource", Kind::Final, Phase::Info)
                .value(json!({"workload": "set", "value": v}))
                .at(100)
        };
        let mut good: Vec<Event> = w.clone().into();
        good.push(a.clone());
        good.push(set(json!(["w1-1"])));
        assert_eq!(check(Check::C4, good), 0);
        let mut bad: Vec<Event> = w.into();
        bad.push(a);
        bad.push(set(json!(["w2-1"])));
        assert_eq!(check(Check::C4, bad), 1);
    }
}
