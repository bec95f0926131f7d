//! The minutes around each finding, drawn as the chaos report draws a run.
//!
//! While timelines are on, the auditor keeps for each name and resource what happened on it
//! in the last `window_ms` before the watermark (holds with their tokens, the server's
//! promises, losses, fence accesses). A finding copies that, goes on collecting for another
//! `window_ms`, and is then drawn: one lane per host, the finding framed in red. Memory is
//! the event rate times the window, and at most [`LIMIT`] timelines are kept.

use std::collections::{HashMap, VecDeque};

use serde_json::{Value, json};

use super::{Finding, utc};

/// The most timelines kept; later findings are counted, not drawn.
pub(crate) const LIMIT: usize = 100;

/// Something to draw.
#[derive(Debug, Clone)]
pub(crate) enum Mark {
    /// A hold from grant to its end, `how` it ended.
    Hold {
        lane: String,
        from: u64,
        to: u64,
        token: u64,
        how: &'static str,
    },
    /// The server's promise under a hold.
    Promise {
        lane: String,
        from: u64,
        to: u64,
        token: u64,
    },
    /// A loss the holder was told of.
    Loss {
        lane: String,
        at: u64,
        reason: String,
        token: Option<u64>,
    },
    /// A fence access.
    Access {
        lane: String,
        at: u64,
        accepted: bool,
        token: Option<u64>,
    },
}

impl Mark {
    /// When it ends: it is dropped once the window has passed that.
    fn end(&self) -> u64 {
        match self {
            Self::Hold { to, .. } | Self::Promise { to, .. } => *to,
            Self::Loss { at, .. } | Self::Access { at, .. } => *at,
        }
    }

    fn start(&self) -> u64 {
        match self {
            Self::Hold { from, .. } | Self::Promise { from, .. } => *from,
            Self::Loss { at, .. } | Self::Access { at, .. } => *at,
        }
    }
}

#[derive(Debug, Clone)]
struct Pending {
    finding: Finding,
    lanes: Vec<String>,
    from: u64,
    until: u64,
    marks: Vec<Mark>,
}

/// The recent marks of every subject, and the timelines being collected and drawn.
#[derive(Debug, Default, Clone)]
pub(crate) struct Timelines {
    window_ms: u64,
    recent: HashMap<String, VecDeque<Mark>>,
    pending: Vec<Pending>,
    drawn: Vec<Value>,
    /// Findings past [`LIMIT`], not drawn.
    pub(crate) left_out: u64,
}

impl Timelines {
    pub(crate) fn new(window_ms: u64) -> Self {
        Self {
            window_ms,
            ..Self::default()
        }
    }

    /// Records `mark` on `subject` (a lock name or a fenced resource).
    pub(crate) fn mark(&mut self, subject: &str, mark: Mark) {
        for pending in &mut self.pending {
            if pending.finding.subject == subject {
                pending.marks.push(mark.clone());
            }
        }
        match self.recent.get_mut(subject) {
            Some(marks) => marks.push_back(mark),
            None => {
                self.recent
                    .insert(subject.to_owned(), VecDeque::from([mark]));
            }
        }
    }

    /// Starts the timeline of `finding`, whose hosts are `lanes`.
    pub(crate) fn found(&mut self, finding: &Finding, lanes: Vec<String>) {
        if self.drawn.len() + self.pending.len() >= LIMIT {
            self.left_out += 1;
            return;
        }
        let from = finding.at_ms.saturating_sub(self.window_ms);
        let marks = self
            .recent
            .get(&finding.subject)
            .map(|marks| marks.iter().filter(|m| m.end() >= from).cloned().collect())
            .unwrap_or_default();
        self.pending.push(Pending {
            finding: finding.clone(),
            lanes,
            from,
            until: finding
                .at_ms
                .saturating_add(finding.overlap_ms)
                .saturating_add(self.window_ms),
            marks,
        });
    }

    /// Drops marks the window has passed and draws the timelines it completed.
    pub(crate) fn advance(&mut self, watermark: u64) {
        let horizon = watermark.saturating_sub(self.window_ms);
        self.recent.retain(|_, marks| {
            marks.retain(|m| m.end() >= horizon);
            !marks.is_empty()
        });
        let (done, pending): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.until < watermark);
        self.pending = pending;
        self.drawn.extend(done.into_iter().map(draw));
    }

    /// The timelines drawn so far (each in [`crate::report::timeline`]'s shape).
    pub(crate) fn drawn(&self) -> &[Value] {
        &self.drawn
    }
}

/// One finding's timeline, times in µs from its window's start.
fn draw(pending: Pending) -> Value {
    let Pending {
        finding,
        mut lanes,
        from,
        until,
        marks,
    } = pending;
    let end = until.saturating_sub(from).max(1);
    let t = |ms: u64| {
        ms.clamp(from, until)
            .saturating_sub(from)
            .saturating_mul(1_000)
    };
    let (mut holds, mut grants, mut losses, mut accesses) = (vec![], vec![], vec![], vec![]);
    let finding_lanes = lanes.clone();
    for mark in marks
        .iter()
        .filter(|m| m.end() >= from && m.start() <= until)
    {
        let lane = match mark {
            Mark::Hold { lane, .. }
            | Mark::Promise { lane, .. }
            | Mark::Loss { lane, .. }
            | Mark::Access { lane, .. } => lane,
        };
        if !lanes.contains(lane) {
            lanes.push(lane.clone());
        }
        match mark {
            Mark::Hold {
                lane,
                from,
                to,
                token,
                how,
            } => holds.push(
                json!({"lane": lane, "from": t(*from), "to": t(*to), "token": token, "how": how}),
            ),
            Mark::Promise {
                lane,
                from,
                to,
                token,
            } => grants.push(json!({"lane": lane, "from": t(*from), "to": t(*to), "token": token})),
            Mark::Loss {
                lane,
                at,
                reason,
                token,
            } => losses.push(json!({"lane": lane, "t": t(*at), "reason": reason, "token": token})),
            Mark::Access {
                lane,
                at,
                accepted,
                token,
            } => accesses.push(json!({
                "lane": lane, "t": t(*at), "kind": "w",
                "answer": if *accepted { "accepted" } else { "refused" }, "token": token,
            })),
        }
    }
    lanes.sort();
    json!({
        "title": format!("{} · {} · {}", finding.check, finding.subject, utc(finding.at_ms)),
        "replay": format!("window {} to {} (host clocks)", utc(from), utc(until)),
        "good": false,
        "error": null,
        "end": end.saturating_mul(1_000),
        "lanes": lanes,
        "holds": holds,
        "grants": grants,
        "accesses": accesses,
        "losses": losses,
        "faults": [],
        "violations": [{
            "check": finding.check, "from": t(finding.at_ms),
            "to": t(finding.at_ms.saturating_add(finding.overlap_ms.max(1))),
            "lanes": finding_lanes, "message": finding.detail, "expected": false,
        }],
        "verdicts": [{
            "check": finding.check, "name": finding.subject, "status": "Fail", "symbol": "✗",
            "summary": finding.detail,
        }],
    })
}
