"""The demo's report: one HTML page with inline PNG plots (matplotlib), readable offline."""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .timeline import Timeline
from .traffic import Answer

ACTION_STYLE = {"Promoted": ("#2a9d8f", "promoted"), "SpeculationOff": ("#e9c46a", "speculation off"),
                "RolledBack": ("#e63946", "rolled back"), "ShadowStarted": ("#6a4c93", "shadow"),
                "ShadowPromoted": ("#2a9d8f", "shadow promoted"), "ShadowRejected": ("#6a4c93", "shadow rejected")}
VERSION_COLOURS = ["#457b9d", "#f4a261", "#6a4c93", "#2a9d8f"]


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def acceptance_plot(timeline: Timeline, verdicts: dict[str, dict[str, Any]]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline.samples[0].t if timeline.samples else time.time()
    points = timeline.acceptance_points()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    versions = sorted({p[3] for p in points} | set(verdicts), key=lambda v: int(v) if v.isdigit() else 0)
    colour = {v: VERSION_COLOURS[i % len(VERSION_COLOURS)] for i, v in enumerate(versions)}
    for v in versions:
        pts = [p for p in points if p[3] == v]
        if pts:
            ax.scatter([p[0] - t0 for p in pts], [p[1] for p in pts], s=[max(12, min(120, p[2])) for p in pts],
                       color=colour[v], alpha=0.8, label=f"live acceptance, v{v} (dot size: tokens drafted)")
    # The gated baseline of whichever version the engine served, as a step line.
    seg_t, seg_v = [], []
    for s in timeline.samples:
        base = (verdicts.get(s.version) or {}).get("acceptanceRate")
        seg_t.append(s.t - t0)
        seg_v.append(base if base is not None else float("nan"))
    if seg_t:
        ax.plot(seg_t, seg_v, color="#555", linestyle="--", linewidth=1.2, label="gated acceptance of the serving release")
    shown = 0
    for t, action, h in timeline.history_events():
        if action in ACTION_STYLE:
            c, word = ACTION_STYLE[action]
            ax.axvline(t - t0, color=c, linewidth=2, alpha=0.9)
            # Staggered heights: actions seconds apart would print over each other.
            ax.text(t - t0, 1.01 + 0.06 * (shown % 2),
                    f"{word} v{h.get('toVersion') if action != 'SpeculationOff' else h.get('fromVersion')}",
                    fontsize=8, color=c, ha="center", va="bottom", transform=ax.get_xaxis_transform())
            shown += 1
    for i, (start, end) in enumerate(timeline.speculation_off_spans()):
        ax.axvspan(start - t0, end - t0, color="#888", alpha=0.3, hatch="//", fill=False, linewidth=0,
                   label="the pod reported speculation off" if i == 0 else None)
    # The drifting traffic runs until the operator decides: its rollback, or the demo's mark
    # that it decided against one.
    ends = [t for t, action, _ in timeline.history_events() if action == "RolledBack"] + \
        [t for t, label in timeline.marks if label == "no rollback"]
    for t, label in timeline.marks:
        if label.startswith("drift:"):
            # Shaded from the first drifting request to the operator's decision, when the demo stops it.
            end = min([e for e in ends if e >= t] or [t0 + max(seg_t or [t - t0])])
            ax.axvspan(t - t0, end - t0, color="#e63946", alpha=0.07)
            ax.text(t - t0, 0.02, " " + label[len("drift:"):].strip(), fontsize=8, color="#a4161a",
                    transform=ax.get_xaxis_transform())
        elif label.startswith("shadow:") and label.endswith("scored on live traffic"):
            # Shaded while the candidate is scored: until the demo's mark of the verdict.
            end = min([m for m, other in timeline.marks if m > t and other.startswith("shadow:")]
                      or [t0 + max(seg_t or [t - t0])])
            ax.axvspan(t - t0, end - t0, color="#6a4c93", alpha=0.07)
            # Above the drift chapter's label, which can run this far.
            ax.text(t - t0, 0.08, " scored in shadow", fontsize=8, color="#6a4c93",
                    transform=ax.get_xaxis_transform())
        elif label.startswith("probe:"):
            ax.axvline(t - t0, color="#e9c46a", linewidth=1.5, linestyle=":")
            ax.text(t - t0, 0.10, " probe", fontsize=8, color="#b5891b", transform=ax.get_xaxis_transform())
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("seconds since the pair was applied")
    ax.set_ylabel("accepted / drafted tokens")
    ax.set_title("Live acceptance vs the gated baseline, with the operator's actions", pad=26)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    out = _png(fig)
    plt.close(fig)
    return out


def speedup_plot(answers: list[tuple[str, Answer]], verdicts: dict[str, dict[str, Any]]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live: dict[str, list[float]] = {}
    for label, a in answers:
        if a.speedup and label != "drift":
            live.setdefault(a.category, []).append(a.speedup)
    cats = sorted(set(live) | {c for v in verdicts.values() for c in (v.get("categories") or {})})
    series = [(f"gate v{v}", {c: (d.get("categories") or {}).get(c, {}).get("speedup") for c in cats})
              for v, d in sorted(verdicts.items())]
    series.append(("live (streamed answers)", {c: statistics.median(live[c]) if c in live else None for c in cats}))
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cats))]
        ys = [vals.get(c) or 0.0 for c in cats]
        bars = ax.bar(xs, ys, width=width * 0.95, label=name, color=VERSION_COLOURS[i % len(VERSION_COLOURS)]
                      if not name.startswith("live") else "#1d3557")
        for x, y, c in zip(xs, ys, cats):
            if vals.get(c):
                ax.text(x, y + 0.02, f"{y:.2f}x", ha="center", va="bottom", fontsize=8)
        del bars
    ax.axhline(1.0, color="#555", linestyle="--", linewidth=1)
    ax.text(len(cats) - 0.5, 1.0, " target-only", va="bottom", ha="right", fontsize=8, color="#555")
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("speedup over target-only")
    ax.set_title("Speedup per category: measured by the gate, and on the streamed answers")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    out = _png(fig)
    plt.close(fig)
    return out


def _table(rows: list[list[str]], head: list[str]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _ref(ref: dict[str, Any] | None) -> str:
    ref = ref or {}
    return f"{ref['drafter']} drafter" if ref.get("drafter") else str(ref.get("source"))


def _fmt(v: Any, pattern: str = "{:.2f}") -> str:
    return pattern.format(v) if isinstance(v, (int, float)) else "–"


def drift_section(drift: dict[str, Any]) -> str:
    """The drift chapter's numbers: the policy the demo set and what each part of it measured."""
    if not drift:
        return ""
    policy = ", ".join(f"{k} {v}" for k, v in (drift.get("policy") or {}).items())
    out = [f"<h2>Drift chapter</h2><p>Drift policy of the pair (spec.drift): {html.escape(policy)}.</p>"]
    shift = drift.get("trafficShift")
    if shift:
        out.append(f"<p><b>Traffic shift</b>: {shift.get('requests')} requests in {shift.get('seconds')} s, "
                   f"'{html.escape(str(shift.get('category')))}' never gated. status.live.trafficShift (drafted "
                   f"tokens, not judged): <code>{html.escape(json.dumps(shift.get('trafficShift')))}</code>; "
                   f"gated categories' live acceptance: <code>{html.escape(json.dumps(shift.get('liveAcceptance')))}</code>; "
                   f"operator actions: {html.escape(', '.join(shift.get('actions') or []) or 'none')}"
                   + ("; a gated window was judged meanwhile.</p>" if shift.get("windowJudged") else
                      "; <b>no gated window was judged meanwhile</b>: no action shows only that nothing was "
                      "judged.</p>"))
    shift = drift.get("domainShift")
    if shift:
        out.append(f"<p><b>Domain shift</b>: requests labelled '{html.escape(str(shift.get('category')))}' (gated at "
                   f"{_fmt(shift.get('gatedV2'), '{:.0%}')} by v2, {_fmt(shift.get('gatedV1'), '{:.0%}')} by v1) "
                   f"whose content is free-form writing. Before it started, from the two gates: "
                   f"{html.escape(str(shift.get('prediction')))}.</p>")
    ladder = drift.get("ladder")
    if ladder:
        rows = [[_fmt(t, "{:.1f} s"), html.escape(stage)] for t, stage in ladder.get("timeline") or []]
        out.append(f"<p><b>Drift ladder ({html.escape(str(ladder.get('chapter')))})</b>: {ladder.get('requests')} "
                   f"requests, acceptance {_fmt(ladder.get('acceptance'), '{:.0%}')} over {ladder.get('drafted')} "
                   f"drafted tokens (none drafted while speculation was off). The operator's decision: "
                   f"{html.escape(str(ladder.get('decision') or '-'))}</p>"
                   + _table(rows, ["since the chapter started", "step"]))
    out.append(learning_section(drift.get("learning")))
    return "".join(out)


def learning_section(loop: dict[str, Any] | None) -> str:
    """The domain shift chapter's end: the operator's learning loop, step by step, with the Events
    it posted and acceptance on the shifted category before, during and after (demo/learning.py)."""
    if not loop:
        return ""
    rows = [[_fmt(t, "{:.1f} s"), html.escape(stage)] for t, stage in loop.get("timeline") or []]
    figures = []
    for when, key in (("before the shift", "before"), ("during the shift", "during"),
                      ("after the new release", "after")):
        f = loop.get(key) or {}
        figures.append([when, _fmt(f.get("firstPosition")), str(f.get("drafts", "-")), _fmt(f.get("tokens"), "{:.0%}"),
                        str(f.get("drafted", "-")), str(f.get("requests", "-"))])
    learned = loop.get("learnedRelease") or {}
    events = ", ".join(f"{k} x{v}" for k, v in sorted((loop.get("events") or {}).items())) or "none read"
    return (f"<p><b>Learning loop</b>: no rollback helped, so the operator trained a drafter for "
            f"'{html.escape(str(loop.get('category')))}' of v{html.escape(str(loop.get('version')))} on the traffic "
            f"its pods captured and took it the usual road: v{html.escape(str(loop.get('candidate')))}, stage "
            f"{html.escape(str(learned.get('stage')))} (judged against {html.escape(str(learned.get('reference')))}). "
            f"Training: {html.escape(str((loop.get('training') or {}).get('message', ''))[:400])}. "
            f"Events: {html.escape(events)}.</p>"
            + _table(rows, ["since the loop started", "step"])
            + _table(figures, ["acceptance on the category", "first position", "rounds", "drafted tokens accepted",
                               "drafted", "requests"]))


def shadow_section(shadow: dict[str, Any] | None) -> str:
    """The shadow chapter: the candidate, each step with its time, the verdict and its numbers
    per category (status.shadow as the operator wrote it)."""
    if not shadow:
        return ""
    from .shadow_chapter import numbers_rows

    status = shadow.get("status") or {}
    steps = [[_fmt(t, "{:.1f} s"), html.escape(stage)] for t, stage in shadow.get("timeline") or []]
    rows = [[html.escape(x) for x in row] for row in numbers_rows(status)]
    cond = shadow.get("condition") or {}
    return (f"<h2>Shadow chapter</h2><p>v{html.escape(str(shadow.get('version')))}, a candidate that changes only "
            f"the draft side, scored on the pods of v{html.escape(str(shadow.get('champion')))} while they served "
            f"({html.escape(str(shadow.get('requests')))} requests answered, {html.escape(str(shadow.get('failed')))} "
            f"failed; {_fmt(status.get('share'), '{:.0%}')} of them scored; {_fmt(shadow.get('seconds'), '{:.0f}')} s "
            f"from the spec change to the verdict). <b>ShadowScored={html.escape(str(cond.get('status', '-')))} "
            f"{html.escape(str(cond.get('reason', '')))}</b>: {html.escape(str(shadow.get('meaning', '')))}</p>"
            f"<p>The operator's verdict: {html.escape(str(cond.get('message', '-')))}</p>"
            + _table(rows, ["category", "candidate alpha", "champion alpha", "difference (99% bounds)", "requests",
                            "says"])
            + _table(steps, ["since the spec change", "step"])
            + f"<p>v{html.escape(str(shadow.get('servingAfter')))} serving after the verdict.</p>")


def write_report(path: Path, pair: dict[str, Any], timeline: Timeline, answers: list[tuple[str, Answer]],
                 verdicts: dict[str, dict[str, Any]], mlflow_url: str, model: str, seconds: float,
                 drift: dict[str, Any] | None = None, shadow: dict[str, Any] | None = None) -> Path:
    st = pair.get("status") or {}
    history = st.get("history") or []
    outcome = ("rolled back" if any(h.get("action") == "RolledBack" for h in history) else st.get("phase", "?"))
    gates = []
    for v, d in sorted(verdicts.items()):
        cats = ", ".join(f"{html.escape(c)} {_fmt(x.get('acceptanceRate'), '{:.0%}')}" for c, x in (d.get("categories") or {}).items())
        gates.append([f"<a href='{mlflow_url}/#/models/{model}/versions/{v}'>v{v}</a>", _fmt(d.get("greedyIdentity"), "{:.0%}"),
                      _fmt(d.get("acceptanceRate"), "{:.0%}"), cats, _fmt(d.get("speedup"), "{:.2f}x"),
                      html.escape(str(d.get("bestSpeculation"))), "passed" if d.get("passed") else "failed"])
    hist_rows = [[html.escape(h.get("time", "")), f"<b>{html.escape(h.get('action', ''))}</b>",
                  html.escape(f"v{h.get('fromVersion') or '-'} → v{h.get('toVersion') or '-'}"), html.escape(h.get("reason", ""))]
                 for h in history]
    ans_rows = []
    for label, a in answers:
        if label in ("drift", "traffic shift", "shadow", "learning loop", "after learning"):
            continue
        ans_rows.append([html.escape(label), html.escape(a.category), html.escape(a.prompt.splitlines()[0][:70]),
                         html.escape(a.text[:160]) + ("…" if len(a.text) > 160 else ""),
                         _fmt(a.acceptance, "{:.0%}"), _fmt(a.speedup, "{:.2f}x"), html.escape(a.error)])
    drift_answers = [a for label, a in answers if label == "drift"]
    drift_note = ""
    if drift_answers:
        d = sum(a.drafted for a in drift_answers)
        acc = sum(a.accepted for a in drift_answers) / d if d else None
        drift_note = (f"<p>{len(drift_answers)} requests during the drift; acceptance over their drafted tokens: "
                      f"{_fmt(acc, '{:.0%}')} ({d} drafted).</p>")
    drift_note += drift_section(drift or {}) + shadow_section(shadow)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>specpair demo report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1080px;margin:2em auto;color:#222;padding:0 1em}}
h1{{margin-bottom:.2em}} .sub{{color:#666;margin-top:0}} table{{border-collapse:collapse;width:100%;font-size:13px;margin:.5em 0 1.5em}}
td,th{{border-bottom:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}} th{{background:#f4f4f4}}
.cards{{display:flex;gap:1em;margin:1em 0}} .card{{flex:1;background:#f6f8fa;border-radius:8px;padding:.7em 1em}}
.card b{{font-size:1.4em;display:block}} img{{max-width:100%}}</style></head><body>
<h1>specpair: the whole loop on one machine</h1>
<p class="sub">pair <code>{html.escape(pair.get('metadata', {}).get('namespace', ''))}/{html.escape(pair.get('metadata', {}).get('name', ''))}</code>,
target <code>{html.escape(_ref((pair.get('spec') or {}).get('target')))}</code>,
draft <code>{html.escape(_ref((pair.get('spec') or {}).get('draft')))}</code> — run took {seconds:.0f} s —
<a href="{mlflow_url}/#/models/{model}">releases in MLflow</a></p>
<div class="cards"><div class="card">serving now<b>v{html.escape(str(st.get('servingVersion', '?')))}</b>{html.escape(st.get('phase', ''))}</div>
<div class="card">releases<b>{len(verdicts)}</b>gated in MLflow</div>
<div class="card">outcome<b>{html.escape(outcome)}</b>{html.escape(str(st.get('message', ''))[:90])}</div></div>
<h2>Acceptance over time</h2><img src="data:image/png;base64,{acceptance_plot(timeline, verdicts)}" alt="acceptance over time">
{drift_note}
<h2>Speedup per category</h2><img src="data:image/png;base64,{speedup_plot(answers, verdicts)}" alt="speedup per category">
<p>Gate bars: golden prompts of that release, target-only vs speculative on this machine. Live bars: each streamed
answer timed against the same request decoded target-only (requests during the drift are not compared).
A missing bar means that release had no golden prompt, or no answer was compared, in that category.</p>
<h2>What the operator did</h2>{_table(hist_rows, ['time (UTC)', 'action', 'versions', 'reason'])}
<h2>Gate results (one MLflow model version each)</h2>{_table(gates, ['release', 'greedy identity', 'acceptance', 'per category', 'speedup', 'best settings', 'verdict'])}
<h2>Streamed answers</h2>{_table(ans_rows, ['when', 'category', 'prompt', 'answer', 'acceptance', 'speedup', 'error'])}
</body></html>"""
    path.write_text(page)
    return path
