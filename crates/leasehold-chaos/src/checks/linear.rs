//! C7: the backend's answers are linearizable against a fenced lease mutex.
//!
//! The model: a lock has at most one holder (owner, token, the end of the lease the server
//! promised) and the highest token it ever granted. A grant to a new owner needs the lock
//! free — or its holder's promise over by the latest moment the grant can have taken
//! effect — and a token above every earlier one; a grant to the holder's own owner id is
//! an adoption (same token, longer promise). A renewal succeeds only for the holder; a
//! renewal or release answering "not held" to the holder is legal only once its promise is
//! over. A release succeeds only for the holder. Operations without an answer may have
//! taken effect or not.

use std::collections::HashMap;

use super::{Facts, Finding, Violation};
use crate::history::{Expiry, History, Kind, Phase};
use crate::wgl::{self, Call, Model, Outcome};

/// What a backend call asked and answered (`None`: no answer came).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockOp {
    /// An acquire by `owner`; `Some(Some((token, promise)))` granted, `Some(None)` busy.
    Acquire {
        /// The owner (interned).
        owner: u32,
        /// The answer.
        answer: Option<Option<(u64, u64)>>,
    },
    /// A renewal by `owner`; `Some(Some(promise))` renewed, `Some(None)` lost.
    Renew {
        /// The owner.
        owner: u32,
        /// The answer.
        answer: Option<Option<u64>>,
    },
    /// A release by `owner`; `Some(true)` released, `Some(false)` not held.
    Release {
        /// The owner.
        owner: u32,
        /// The answer.
        answer: Option<bool>,
        /// "Released" may mean something other than the grant.
        /// It may be its place in the queue (the owner waited), or its own stale copies (a
        /// backend with several copies of each lock).
        queued: bool,
    },
}

/// A call of the lock history.
pub type LockCall = Call<LockOp>;

/// The fenced lease mutex (see the module documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseMutex;

// A server that tells the holder it lost its lock before the lease it promised is over
// has forgotten it early: that alone breaks no mutual exclusion (the holder stops), so it
// is legal, but the lock stays reserved until the promise ends — a grant to another owner
// before then is a double grant — unless the owner gives it up first (a release) — and it
// is never renewed or adopted again.

/// A holder in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Holder {
    owner: u32,
    /// Unknown after a grant nobody heard of.
    token: Option<u64>,
    /// The end of the lease the server promised.
    promise: u64,
    /// The server already said the owner no longer holds it (before the promise ended).
    denied: bool,
}

/// The model's state.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MutexState {
    holder: Option<Holder>,
    /// The highest token granted.
    max_token: u64,
}

impl Model for LeaseMutex {
    type State = MutexState;
    type Op = LockOp;

    fn init(&self) -> MutexState {
        MutexState {
            holder: None,
            max_token: 0,
        }
    }

    fn step(&self, s: &MutexState, c: &LockCall) -> Vec<MutexState> {
        // The latest moment the operation can have taken effect.
        let latest = c.ret.unwrap_or(u64::MAX);
        let expirable = |promise: u64| promise <= latest;
        let holder = s.holder;
        let with = |holder, max_token| MutexState { holder, max_token };
        let held = |owner, token, promise| Holder {
            owner,
            token,
            promise,
            denied: false,
        };
        match c.op {
            LockOp::Acquire { owner, answer } => match answer {
                Some(None) => vec![s.clone()],
                Some(Some((token, promise))) => {
                    let mut next = Vec::new();
                    match holder {
                        Some(h) if h.owner == owner && h.token == Some(token) && !h.denied => {
                            let h = held(owner, h.token, h.promise.max(promise));
                            next.push(with(Some(h), s.max_token));
                        }
                        Some(h) if h.owner == owner && h.token.is_none() && token > s.max_token => {
                            let h = held(owner, Some(token), h.promise.max(promise));
                            next.push(with(Some(h), token));
                        }
                        _ => {}
                    }
                    let free = holder.is_none_or(|h| expirable(h.promise));
                    if free && token > s.max_token {
                        next.push(with(Some(held(owner, Some(token), promise)), token));
                    }
                    next
                }
                // A grant nobody heard of is resolved by its owner: adopted by a later
                // grant (which the model checks as a grant) or released. Until then it
                // changes nothing the model could check without knowing when it landed.
                None => vec![s.clone()],
            },
            LockOp::Renew { owner, answer } => match (answer, holder) {
                (Some(Some(promise)), Some(h)) if h.owner == owner && !h.denied => {
                    let h = held(owner, h.token, h.promise.max(promise));
                    vec![with(Some(h), s.max_token)]
                }
                (Some(Some(_)), _) => vec![],
                (Some(None), Some(h)) if h.owner == owner => {
                    if expirable(h.promise) {
                        vec![with(None, s.max_token)]
                    } else {
                        vec![with(Some(Holder { denied: true, ..h }), s.max_token)]
                    }
                }
                _ => vec![s.clone()],
            },
            LockOp::Release {
                owner,
                answer,
                queued,
            } => match (answer, holder) {
                // Whatever it removed, the owner has given the lock up.
                (Some(true), Some(h)) if h.owner == owner => vec![with(None, s.max_token)],
                (Some(true), _) if queued => vec![s.clone()],
                (Some(true), _) => vec![],
                (Some(false), Some(h)) if h.owner == owner => {
                    if expirable(h.promise) {
                        vec![with(None, s.max_token)]
                    } else {
                        vec![with(Some(Holder { denied: true, ..h }), s.max_token)]
                    }
                }
                (None, Some(h)) if h.owner == owner => {
                    vec![s.clone(), with(None, s.max_token)]
                }
                _ => vec![s.clone()],
            },
        }
    }
}

/// An interned owner: its id and the process that first used it.
type OwnerName = (String, String);

/// The most search steps per lock before C7 gives up.
const BUDGET: u64 = 3_000_000;

fn promise(expiry: Option<Expiry>, invoked: u64) -> u64 {
    expiry.unwrap_or(Expiry::Never).promise(invoked)
}

/// The lock history of `history`: backend calls per lock, with owners interned.
/// Busy answers are left out (legal in every state, and they change nothing), as are calls
/// that failed without being applied.
pub(crate) fn lock_calls(
    history: &History,
    facts: &Facts,
) -> (Vec<(String, LockCall)>, Vec<OwnerName>) {
    let copies = facts.info.copies;
    // A grant that never expires ends when its holding process is killed.
    let killed = |process: &str, after: u64| {
        facts
            .faults
            .iter()
            .filter(|f| f.action == "kill" && f.target == process && f.start > after)
            .map(|f| f.start)
            .min()
            .unwrap_or(u64::MAX)
    };
    let mut owners: HashMap<String, u32> = HashMap::new();
    let mut names: Vec<OwnerName> = Vec::new();
    let acquires = history.ops(Kind::Acquire);
    let granted: std::collections::HashSet<&str> = acquires
        .iter()
        .filter(|op| op.answered("granted"))
        .filter_map(|op| op.invoke.owner.as_deref())
        .collect();
    let waited: std::collections::HashSet<&str> = acquires
        .iter()
        .filter(|op| op.answered("busy") || op.outcome() == Phase::Unknown)
        .filter_map(|op| op.invoke.owner.as_deref())
        .collect();
    let mut calls = Vec::new();
    for kind in [Kind::Acquire, Kind::Renew, Kind::Release] {
        for op in history.ops(kind) {
            if op.outcome() == Phase::Fail {
                continue;
            }
            let owner_text = op.owner().unwrap_or("").to_owned();
            let owner = *owners.entry(owner_text.clone()).or_insert_with(|| {
                names.push((owner_text.clone(), op.process().to_owned()));
                (names.len() - 1) as u32
            });
            let known = op.outcome() == Phase::Ok;
            let done = op.done;
            let op_kind = match kind {
                Kind::Acquire => {
                    let answer = known.then(|| match op.answer() {
                        Some("granted") => Some((
                            op.token().unwrap_or(0),
                            match done.and_then(|d| d.expiry) {
                                Some(Expiry::Never) | None => killed(op.process(), op.start()),
                                expiry => promise(expiry, op.start()),
                            },
                        )),
                        _ => None,
                    });
                    if answer == Some(None) {
                        continue;
                    }
                    LockOp::Acquire { owner, answer }
                }
                Kind::Renew => LockOp::Renew {
                    owner,
                    answer: known.then(|| {
                        (op.answer() == Some("renewed"))
                            .then(|| promise(done.and_then(|d| d.expiry), op.start()))
                    }),
                },
                _ => LockOp::Release {
                    owner,
                    // With several copies of a lock (Redlock), "not held" is what the nodes
                    // that answered said; the others may have released.
                    answer: known
                        .then(|| op.answer() == Some("released"))
                        .filter(|released| *released || copies == 1),
                    queued: waited.contains(owner_text.as_str())
                        || (copies > 1 && granted.contains(owner_text.as_str())),
                },
            };
            calls.push((
                op.invoke.lock.clone().unwrap_or_default(),
                Call {
                    call: op.start(),
                    ret: op.end(),
                    op: op_kind,
                },
            ));
        }
    }
    (calls, names)
}

pub(super) fn c7_linearizable(history: &History, facts: &Facts) -> Finding {
    let (calls, owners) = lock_calls(history, facts);
    if calls.is_empty() {
        return Finding::nothing(facts, "no backend call");
    }
    let n = calls.len();
    let (outcome, part) = wgl::check_partitioned(&LeaseMutex, calls, BUDGET);
    let describe = |c: &LockCall| {
        let (owner, verb) = match c.op {
            LockOp::Acquire { owner, answer } => (
                owner,
                match answer {
                    Some(Some((token, _))) => format!("acquire granted token {token}"),
                    Some(None) => "acquire busy".into(),
                    None => "acquire (no answer)".into(),
                },
            ),
            LockOp::Renew { owner, answer } => (
                owner,
                match answer {
                    Some(Some(_)) => "renewal renewed".into(),
                    Some(None) => "renewal answered lost".into(),
                    None => "renewal (no answer)".into(),
                },
            ),
            LockOp::Release { owner, answer, .. } => (
                owner,
                match answer {
                    Some(true) => "release released".into(),
                    Some(false) => "release answered not held".into(),
                    None => "release (no answer)".into(),
                },
            ),
        };
        let (id, process) = &owners[owner as usize];
        (process.clone(), format!("{process}'s {verb} (owner {id})"))
    };
    match (outcome, part) {
        (Outcome::Linearizable, _) => {
            Finding::measured(Vec::new(), format!("{n} calls linearizable"))
        }
        (Outcome::GaveUp(steps), Some((lock, _))) => Finding {
            undecided: Some(format!("gave up on lock {lock} after {steps} search steps")),
            ..Finding::default()
        },
        (Outcome::NotLinearizable { stuck, prefix }, Some((_, calls))) => {
            let c = &calls[stuck];
            let (process, what) = describe(c);
            let before: Vec<String> = prefix
                .iter()
                .rev()
                .take(3)
                .rev()
                .map(|i| describe(&calls[*i]).1)
                .collect();
            let message = format!(
                "{what} at t={} fits no order (after: {})",
                super::ms(c.call),
                if before.is_empty() {
                    "nothing".into()
                } else {
                    before.join("; ")
                }
            );
            let end = c.ret.unwrap_or(c.call);
            Finding::measured(
                vec![Violation::during(c.call, end, &[&process], message)],
                format!("{n} calls"),
            )
        }
        // The search names the lock it judged whenever it did not find every lock
        // linearizable.
        _ => Finding {
            undecided: Some("the search gave no verdict".into()),
            ..Finding::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acq(owner: u32, call: u64, ret: Option<u64>, granted: Option<(u64, u64)>) -> LockCall {
        Call {
            call,
            ret,
            op: LockOp::Acquire {
                owner,
                answer: ret.map(|_| granted),
            },
        }
    }

    fn rel(owner: u32, call: u64, ret: u64, released: bool) -> LockCall {
        Call {
            call,
            ret: Some(ret),
            op: LockOp::Release {
                owner,
                answer: Some(released),
                queued: false,
            },
        }
    }

    fn renew(owner: u32, call: u64, ret: u64, promise: Option<u64>) -> LockCall {
        Call {
            call,
            ret: Some(ret),
            op: LockOp::Renew {
                owner,
                answer: Some(promise),
            },
        }
    }

    fn ok(h: &[LockCall]) -> bool {
        wgl::check(&LeaseMutex, h, 100_000) == Outcome::Linearizable
    }

    #[test]
    fn good_lock_histories_are_linearizable() {
        // Grant, release, grant.
        assert!(ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            rel(0, 20, 30, true),
            acq(1, 40, Some(50), Some((2, 1040))),
        ]));
        // A grant after the previous holder's promise ran out, without a release; the
        // stale holder's renewal and release are refused.
        assert!(ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            acq(1, 900, Some(1001), Some((2, 1900))),
            renew(0, 1100, 1110, None),
            rel(0, 1200, 1210, false),
        ]));
        // Adoption: a retry by the same owner gets the same token.
        assert!(ok(&[
            acq(0, 0, None, None),
            acq(0, 100, Some(110), Some((7, 1100))),
            renew(0, 200, 210, Some(1200)),
            rel(0, 300, 310, true),
        ]));
        // A server that forgot a grant early, but granted nobody else before the promise
        // ran out (Redlock's restarted nodes in quarantine).
        assert!(ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            renew(0, 300, 310, None),
            rel(0, 400, 410, false),
            acq(1, 900, Some(1010), Some((2, 2000))),
        ]));
        // A grant concurrent with a release may come after it.
        assert!(ok(&[
            acq(0, 0, Some(100), Some((1, 1000))),
            rel(0, 150, 200, true),
            acq(1, 0, Some(300), Some((2, 1300))),
        ]));
    }

    #[test]
    fn bad_lock_histories_are_not() {
        // Two concurrent grants, each inside the other's promise.
        assert!(!ok(&[
            acq(0, 0, Some(100), Some((2, 1000))),
            acq(1, 0, Some(100), Some((1, 1000))),
        ]));
        // A double grant: the second inside the first's promise.
        assert!(!ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            acq(1, 500, Some(510), Some((2, 1500))),
        ]));
        // Tokens going backwards.
        assert!(!ok(&[
            acq(0, 0, Some(10), Some((5, 1000))),
            rel(0, 20, 30, true),
            acq(1, 40, Some(50), Some((3, 1040))),
        ]));
        // A release of a lock someone else holds.
        assert!(!ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            rel(1, 20, 30, true),
        ]));
        // The server forgot a grant before its promise ran out, and granted it again
        // before that promise was over.
        assert!(!ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            renew(0, 300, 310, None),
            acq(1, 400, Some(410), Some((2, 1400))),
        ]));
        // A renewal of a lock that was given to another.
        assert!(!ok(&[
            acq(0, 0, Some(10), Some((1, 1000))),
            acq(1, 900, Some(1001), Some((2, 1900))),
            renew(0, 1100, 1110, Some(2100)),
        ]));
    }
}
