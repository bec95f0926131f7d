//! The HTML report: per run, the checks' verdicts and a timeline.
//! The timeline has one lane per worker — its holds with their tokens, the server's promise
//! under each, losses, accesses accepted and refused — faults shaded across the lanes they
//! hit, and violations marked. One self-contained file; the page draws the timelines itself
//! (inline SVG).

use std::collections::{BTreeSet, HashMap};

use serde_json::{Value, json};

use crate::checks::Facts;
use crate::history::{History, Kind, Phase};
use crate::runner::RunReport;

/// The timeline data of one run (what the page draws).
pub fn timeline(report: &RunReport) -> Value {
    let empty = History::default();
    let history = report.history.as_ref().unwrap_or(&empty);
    let facts = Facts::new(history);
    let end = history.end().max(1);
    let mut lanes: BTreeSet<String> = history
        .events()
        .iter()
        .filter(|e| e.process.starts_with('w'))
        .map(|e| e.process.clone())
        .collect();
    for f in &facts.faults {
        if let Some(w) = f.target.strip_prefix("link ") {
            lanes.insert(w.to_owned());
        }
    }
    let lanes: Vec<String> = lanes.into_iter().collect();
    let mut holds = Vec::new();
    let unlocks: HashMap<&str, u64> = history
        .ops(Kind::Unlock)
        .iter()
        .filter_map(|op| Some((op.owner()?, op.start())))
        .collect();
    for h in &facts.holds {
        let (to, how) = match (h.lost, unlocks.get(h.owner.as_str())) {
            (Some(lost), Some(unlock)) if lost < *unlock => (lost, "lost"),
            (_, Some(unlock)) => (*unlock, "released"),
            (Some(lost), None) => (lost, "lost"),
            (None, None) => (end, "open"),
        };
        holds.push(json!({"lane": h.process, "from": h.start, "to": to.max(h.start), "token": h.token, "how": how}));
    }
    let grants: Vec<Value> = facts
        .grants
        .iter()
        .map(|g| {
            json!({"lane": g.process, "from": g.granted, "to": g.end().min(end).max(g.granted), "token": g.token})
        })
        .collect();
    let mut accesses = Vec::new();
    for kind in [Kind::Read, Kind::Write] {
        for op in history.ops(kind) {
            let answer = op.answer().unwrap_or(if op.outcome() == Phase::Unknown {
                "unknown"
            } else {
                "?"
            });
            accesses.push(json!({
                "lane": op.process(), "t": op.start(), "kind": if kind == Kind::Write { "w" } else { "r" },
                "answer": answer, "token": op.token(),
            }));
        }
    }
    let losses: Vec<Value> = history
        .of(Kind::Lost)
        .map(|e| json!({"lane": e.process, "t": e.t, "reason": e.fault, "token": e.token}))
        .collect();
    let faults: Vec<Value> = facts
        .faults
        .iter()
        .map(|f| {
            let lane = if let Some(w) = f.target.strip_prefix("link ") {
                Some(w.to_owned())
            } else if lanes.contains(&f.target) {
                Some(f.target.clone())
            } else {
                None
            };
            json!({"lane": lane, "from": f.start, "to": f.end.min(end), "label": format!("{} {}", f.action, f.target)})
        })
        .collect();
    let mut violations = Vec::new();
    let mut verdicts = Vec::new();
    for v in report.verdicts() {
        verdicts.push(json!({
            "check": v.check.to_string(), "name": v.check.name(), "status": format!("{:?}", v.status),
            "symbol": v.status.symbol(), "summary": v.summary,
        }));
        for x in v.violations.iter().take(50) {
            violations.push(json!({
                "check": v.check.to_string(), "from": x.t, "to": x.until.unwrap_or(x.t).min(end),
                "lanes": x.processes, "message": x.message, "expected": v.status != crate::checks::Status::Fail,
            }));
        }
    }
    let error = match &report.outcome {
        crate::runner::Outcome::Error { message, .. } => Some(message.clone()),
        _ => None,
    };
    json!({
        "title": format!("{} · {} · seed {}{}", report.backend, report.scenario, report.seed,
            report.bug.as_deref().map(|b| format!(" · planted bug {b}")).unwrap_or_default()),
        "replay": report.replay,
        "good": report.is_good(),
        "error": error,
        "end": end,
        "lanes": lanes,
        "holds": holds,
        "grants": grants,
        "accesses": accesses,
        "losses": losses,
        "faults": faults,
        "violations": violations,
        "verdicts": verdicts,
    })
}

/// The whole page for `reports` (runs that were skipped are listed, not drawn).
pub fn html(reports: &[RunReport]) -> String {
    let runs: Vec<Value> = reports
        .iter()
        .filter(|r| r.history.is_some())
        .map(timeline)
        .collect();
    let skipped: Vec<Value> = reports
        .iter()
        .filter_map(|r| match &r.outcome {
            crate::runner::Outcome::Skipped { reason } => {
                Some(json!({"backend": r.backend, "scenario": r.scenario, "reason": reason}))
            }
            _ => None,
        })
        .collect();
    page("leasehold chaos report", &runs, &skipped)
}

/// A self-contained page titled `title` that draws the timelines `runs`.
/// They are in the shape [`timeline`] makes (times in µs from each run's start); the page
/// lists `skipped` below them.
pub fn page(title: &str, runs: &[Value], skipped: &[Value]) -> String {
    let data = json!({"runs": runs, "skipped": skipped});
    // `</` cannot close the script element from inside the data.
    let data = data.to_string().replace("</", "<\\/");
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    PAGE.replace("/*TITLE*/", &title)
        .replace("/*DATA*/null", &data)
}

const PAGE: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>/*TITLE*/</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; }
section.run { border: 1px solid #ccc; border-radius: 6px; padding: .8em 1em; margin: 1em 0; }
section.run.bad { border-color: #c00; }
section.run h2 { font-size: 1.1em; margin: 0 0 .4em; }
code { background: #f4f4f4; padding: 0 .3em; }
table.verdicts { border-collapse: collapse; margin: .5em 0; }
table.verdicts td { padding: 1px 8px; border-bottom: 1px solid #eee; vertical-align: top; }
table.verdicts td:first-child, table.verdicts td:nth-child(2) { white-space: nowrap; }
.Pass { color: #080; } .Fail, .Missed { color: #c00; font-weight: bold; }
.Detected { color: #b60; font-weight: bold; } .Tolerated { color: #b60; } .Skipped { color: #999; }
svg text { font: 11px system-ui, sans-serif; }
.legend span { margin-right: 1.2em; }
.error { color: #c00; }
</style>
</head>
<body>
<h1>/*TITLE*/</h1>
<p class="legend"><span>▇ hold (token)</span><span style="color:#48a">▁ server's promise</span>
<span style="color:#080">| access accepted</span><span style="color:#c00">| refused</span>
<span>✕ loss signalled</span><span style="background:#fd9">&nbsp;fault&nbsp;</span>
<span style="color:#c00">▭ violation</span><span style="color:#b60">▭ expected violation</span></p>
<div id="runs"></div>
<div id="skipped"></div>
<script>
const DATA = /*DATA*/null;
window.onerror = function (msg) { document.body.dataset.error = String(msg); };
(function () {
  const NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent, text) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function draw(run, host) {
    const sec = h("section", {"class": "run" + (run.good ? "" : " bad")}, host);
    h("h2", {}, sec, run.title + (run.good ? "" : " — FAILED"));
    const p = h("p", {}, sec);
    h("code", {}, p, run.replay);
    if (run.error) h("p", {"class": "error"}, sec, "error: " + run.error);
    const table = h("table", {"class": "verdicts"}, sec);
    for (const v of run.verdicts) {
      const tr = h("tr", {}, table);
      h("td", {"class": v.status}, tr, v.symbol + " " + v.check);
      h("td", {}, tr, v.name);
      h("td", {"class": v.status}, tr, v.status);
      h("td", {}, tr, v.summary);
    }
    const W = 1100, left = 40, laneH = 34, top = 18;
    const H = top + laneH * run.lanes.length + 24;
    const svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": "timeline"}, sec);
    const x = (t) => left + (W - left - 10) * Math.min(Math.max(t, 0), run.end) / run.end;
    const laneY = {};
    run.lanes.forEach((name, i) => { laneY[name] = top + i * laneH; });
    // Faults: across every lane, or on their own.
    for (const f of run.faults) {
      const y0 = f.lane && laneY[f.lane] !== undefined ? laneY[f.lane] : top;
      const hgt = f.lane && laneY[f.lane] !== undefined ? laneH : laneH * run.lanes.length;
      const r = el("rect", {x: x(f.from), y: y0, width: Math.max(2, x(f.to) - x(f.from)), height: hgt,
        fill: "#fd9", "fill-opacity": 0.5, "class": "fault"}, svg);
      el("title", {}, r, f.label);
    }
    run.lanes.forEach((name) => {
      const g = el("g", {"class": "lane", "data-lane": name}, svg);
      const y = laneY[name];
      el("line", {x1: left, x2: W - 10, y1: y + laneH - 2, y2: y + laneH - 2, stroke: "#ddd"}, g);
      el("text", {x: 2, y: y + 20}, g, name);
      for (const gr of run.grants.filter((d) => d.lane === name)) {
        el("rect", {x: x(gr.from), y: y + 24, width: Math.max(1, x(gr.to) - x(gr.from)), height: 3, fill: "#48a"}, g);
      }
      for (const hd of run.holds.filter((d) => d.lane === name)) {
        const r = el("rect", {x: x(hd.from), y: y + 8, width: Math.max(2, x(hd.to) - x(hd.from)), height: 14,
          fill: hd.how === "lost" ? "#999" : "#6a6", rx: 2, "class": "hold"}, g);
        el("title", {}, r, "token " + hd.token + " (" + hd.how + ")");
        const label = String(hd.token).length > 6 ? "…" + String(hd.token).slice(-4) : String(hd.token);
        el("text", {x: x(hd.from) + 2, y: y + 19, fill: "#fff"}, g, label);
      }
      for (const a of run.accesses.filter((d) => d.lane === name)) {
        const color = a.answer === "accepted" ? "#080" : (a.answer === "refused" ? "#c00" : "#999");
        el("line", {x1: x(a.t), x2: x(a.t), y1: y + 2, y2: y + 8, stroke: color}, g);
      }
      for (const l of run.losses.filter((d) => d.lane === name)) {
        const t = el("text", {x: x(l.t) - 4, y: y + 19, fill: "#c00"}, g, "✕");
        el("title", {}, t, "lost: " + l.reason);
      }
    });
    for (const v of run.violations) {
      const ys = v.lanes.filter((n) => laneY[n] !== undefined).map((n) => laneY[n]);
      const y0 = ys.length ? Math.min(...ys) : top;
      const y1 = ys.length ? Math.max(...ys) + laneH : top + laneH * run.lanes.length;
      const r = el("rect", {x: x(v.from) - 2, y: y0 + 1, width: Math.max(4, x(v.to) - x(v.from) + 4), height: y1 - y0 - 2,
        fill: "none", stroke: v.expected ? "#b60" : "#c00", "stroke-width": 2, "class": "violation"}, svg);
      el("title", {}, r, v.check + ": " + v.message);
    }
    // A time axis in seconds.
    const seconds = run.end / 1e6;
    for (let s = 0; s <= seconds; s += Math.max(1, Math.round(seconds / 10))) {
      el("text", {x: x(s * 1e6), y: H - 6, fill: "#666"}, svg, s + "s");
    }
  }
  try {
    const host = document.getElementById("runs");
    for (const run of DATA.runs) draw(run, host);
    if (DATA.skipped.length) {
      const div = document.getElementById("skipped");
      h("h2", {}, div, "Not applicable");
      const ul = h("ul", {}, div);
      for (const s of DATA.skipped) h("li", {}, ul, s.backend + " · " + s.scenario + ": " + s.reason);
    }
    document.body.dataset.rendered = String(document.querySelectorAll("g.lane").length);
  } catch (e) {
    document.body.dataset.error = String(e && e.stack || e);
  }
})();
</script>
</body>
</html>
"##;
