"""Simulate live traffic against drift policies: how often a healthy release is rolled back,
and how long a truly drifted one takes to be caught.

    .venv/bin/python bench/drift_simulation.py [--seeds 10] [--hours 3] [--markdown]

Seeded and pure (numpy + the operator's drift module; no servers). Each run is a few hours of
traffic sampled every 30 s from two engine pods, replayed through every policy:

- per request: drafted tokens log-normal (median 80, sigma 0.9; some requests a few thousand),
  acceptance Beta around the category's true mean (concentration 6: requests differ a lot),
  accepted tokens binomial; the gate's baseline is the true mean times a log-normal error
  (sigma 0.1: golden sets are small);
- healthy scenarios (every SpeculationOff or Rollback there is false): steady mixed traffic;
  bursts from one client with unusual prompts; a traffic shift to an ungated category and
  towards a hard gated one; frequent pod restarts; an idle pair with one long request at 0.05
  an hour; a low-traffic pair;
- drift scenarios (from 1 h on): the draft degraded on every category; only the low-baseline
  category (creative 0.20 -> 0.06); one pod degraded while the other restarts every 5 min;
  a degraded draft on a low-traffic pair.
The engine is today's: it drafts nothing while speculation is off (the operator probes).
Policies: the drift module before this rework (overlapping 300 s windows), and the new one with
several settings, with and without the per-request sums the engine should export.

Figures: docs/drift.md, "Measured" (the table --markdown prints).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
from specpair.stats import RequestMoments  # noqa: E402
from specpair_operator.policy import drift  # noqa: E402

DT = 30.0                       # sampling interval (intervalSeconds)
ONSET = 3600.0                  # drift starts after one hour
TRUE = {"code": 0.45, "qa": 0.30, "summarisation": 0.55, "extraction": 0.65, "creative": 0.20}
MIX = {"code": 0.3, "qa": 0.2, "summarisation": 0.2, "extraction": 0.1, "creative": 0.2}
OLD_REV = "8e8797c"             # the last commit with the overlapping-window policy


@dataclass
class Scenario:
    name: str
    drifted: bool
    rate: float = 1.0                                   # requests per second
    mix: dict = field(default_factory=lambda: dict(MIX))
    restarts_every: float | None = None                 # seconds, per pod (random)
    flap_pod: int | None = None                         # this pod restarts every 5 min
    bursts: bool = False
    shift: bool = False
    long_request: bool = False
    drift_factor: float = 0.3                           # acceptance multiplied from ONSET on
    drift_cats: tuple = tuple(TRUE)
    drift_pod: int | None = None


SCENARIOS = [
    Scenario("steady", False),
    Scenario("bursts", False, rate=0.05, bursts=True),
    Scenario("traffic shift", False, shift=True),
    Scenario("restarts", False, restarts_every=1200.0),
    Scenario("idle + long request", False, rate=0.005, long_request=True),
    Scenario("low traffic", False, rate=0.05),
    Scenario("drifted draft", True),
    Scenario("low-baseline category", True, drift_factor=0.3, drift_cats=("creative",)),
    Scenario("one pod, other flaps", True, drift_factor=0.1, drift_pod=0, flap_pod=1),
    Scenario("drift, low traffic", True, rate=0.05),
]


@dataclass
class Traffic:
    """Per-request arrays of one run, and the gate's baselines."""
    t: np.ndarray
    pod: np.ndarray
    cat: np.ndarray          # index into cats
    drafted: np.ndarray
    mean: np.ndarray         # the request's acceptance mean (before Beta noise)
    u: np.ndarray            # uniform draws for the Beta/binomial, fixed per request
    cats: list
    baseline: dict
    previous: dict
    restarts: list           # per pod: sorted restart times


def make_traffic(sc: Scenario, seed: int, hours: float) -> Traffic:
    rng = np.random.default_rng(seed)
    horizon = hours * 3600
    cats = list(TRUE) + ["poetry"]
    rows = []

    def poisson(rate, t0, t1, mix, accept=None):
        n = rng.poisson(rate * (t1 - t0))
        t = rng.uniform(t0, t1, n)
        names = list(mix)
        p = np.array([mix[c] for c in names], float)
        c = rng.choice(len(names), n, p=p / p.sum())
        cidx = np.array([cats.index(names[i]) for i in c], int)
        rows.append((t, cidx, accept))

    if sc.shift:
        poisson(sc.rate, 0, ONSET, sc.mix)
        shifted = {"poetry": 0.6, "creative": 0.25, "code": 0.1, "qa": 0.05}
        poisson(sc.rate, ONSET, horizon, shifted)
    else:
        poisson(sc.rate, 0, horizon, sc.mix)
    if sc.bursts:
        # One client, every ~20 min, 60 s at 3 req/s of code prompts its drafter cannot follow.
        for start in np.arange(600, horizon, 1200) + rng.uniform(0, 300, int(np.ceil((horizon - 600) / 1200))):
            poisson(3.0, start, min(start + 60, horizon), {"code": 1.0}, accept=0.10)
    t = np.concatenate([r[0] for r in rows])
    cidx = np.concatenate([r[1] for r in rows])
    mean = np.concatenate([np.array([TRUE.get(cats[c], 0.08) for c in r[1]]) if r[2] is None
                           else np.full(len(r[0]), r[2]) for r in rows])
    drafted = np.clip(np.round(rng.lognormal(np.log(80), 0.9, len(t))), 4, 4000).astype(np.int64)
    if sc.long_request:
        for h in np.arange(1800, horizon, 3600):
            t = np.append(t, h)
            cidx = np.append(cidx, cats.index("code"))
            mean = np.append(mean, 0.05)
            drafted = np.append(drafted, 3000)
    order = np.argsort(t)
    t, cidx, mean, drafted = t[order], cidx[order], mean[order], drafted[order]
    pod = rng.integers(0, 2, len(t))
    if sc.drifted:
        hit = (t >= ONSET) & np.isin(cidx, [cats.index(c) for c in sc.drift_cats])
        if sc.drift_pod is not None:
            hit &= pod == sc.drift_pod
        mean = np.where(hit, mean * sc.drift_factor, mean)
    baseline = {c: float(v * np.exp(rng.normal(0, 0.1))) for c, v in TRUE.items()}
    baseline[drift.OVERALL] = float(sum(MIX[c] * baseline[c] for c in TRUE))
    previous = {c: float(v * np.exp(rng.normal(0, 0.1))) for c, v in TRUE.items()}
    previous[drift.OVERALL] = float(sum(MIX[c] * previous[c] for c in TRUE))
    restarts = []
    for p in range(2):
        r = []
        if sc.restarts_every:
            r = sorted(rng.uniform(0, horizon, rng.poisson(horizon / sc.restarts_every)).tolist())
        if sc.flap_pod == p:
            r = np.arange(300, horizon, 300).tolist()
        restarts.append(r)
    u = rng.random((len(t), 2))
    return Traffic(t, pod, cidx, drafted, mean, u, cats, baseline, previous, restarts)


def accepted_tokens(tr: Traffic, idx: np.ndarray) -> np.ndarray:
    """Beta(mean, concentration 6) per request, then binomial over its drafted tokens
    (normal approximation driven by the request's fixed uniforms: seeded and vectorised)."""
    from scipy.stats import beta as beta_dist, norm  # noqa: PLC0415
    m = np.clip(tr.mean[idx], 0.01, 0.99)
    k = 6.0
    a = beta_dist.ppf(tr.u[idx, 0], m * k, (1 - m) * k)
    d = tr.drafted[idx]
    acc = np.round(d * a + norm.ppf(np.clip(tr.u[idx, 1], 1e-6, 1 - 1e-6)) * np.sqrt(d * a * (1 - a)))
    return np.clip(acc, 0, d).astype(np.int64)


class Engine:
    """Two pods' cumulative counters, replaying the run's requests step by step."""

    def __init__(self, tr: Traffic, moments: bool, requests: bool):
        self.tr, self.moments, self.requests = tr, moments, requests
        self.acc = accepted_tokens(tr, np.arange(len(tr.t)))
        self.i = 0
        self.cum = [dict() for _ in range(2)]
        self.started = [0.0, 0.0]
        self.speculating = True

    def advance(self, now: float) -> None:
        tr = self.tr
        j = np.searchsorted(tr.t, now, side="right")
        for r in range(self.i, j):
            p = int(tr.pod[r])
            if any(self.started[p] < x <= tr.t[r] for x in tr.restarts[p]):
                self.started[p] = max(x for x in tr.restarts[p] if x <= tr.t[r])
                self.cum[p] = {}
            c = tr.cats[tr.cat[r]]
            if self.speculating:
                done = RequestMoments.of_request(int(tr.drafted[r]), int(self.acc[r]))
            else:   # served target-only: no unit of acceptance, but today's `requests` counts every finished request
                done = replace(RequestMoments.zero(), requests=0 if self.moments else 1)
            self.cum[p][c] = self.cum[p].get(c, RequestMoments.zero()) + done
        for p in range(2):   # restarts between requests
            due = [x for x in tr.restarts[p] if self.started[p] < x <= now]
            if due:
                self.started[p] = max(due)
                self.cum[p] = {}
        self.i = j

    def pods(self) -> list[drift.PodStats]:
        out = []
        for p in range(2):
            cats = {}
            for c, m in self.cum[p].items():
                cats[c] = m if self.moments else \
                    RequestMoments(m.drafted, m.accepted, m.requests if self.requests else None)
            out.append(drift.PodStats(f"engine-{p}/uid-{p}", cats, self.started[p]))
        return out

    def totals(self) -> dict:
        tot: dict = {}
        for p in range(2):
            for c, m in self.cum[p].items():
                t = tot.setdefault(c, [0, 0])   # the old module's [drafted, accepted]
                t[0] += m.drafted
                t[1] += m.accepted
        return tot


def run_new(tr: Traffic, policy: drift.DriftPolicy, hours: float, moments: bool, requests: bool) -> list:
    eng = Engine(tr, moments, requests)
    state, mem, events = drift.DriftState(), drift.Memory(), []
    now = 0.0
    while now < hours * 3600:
        now += DT
        eng.advance(now)
        d = drift.decide(policy, state, mem, now, eng.pods(), tr.baseline, tr.previous)
        state, mem = d.state, d.memory
        eng.speculating = d.speculation
        if d.action:
            events.append((d.action, now))
        if d.action == drift.ROLLBACK:
            break
    return events


def load_old():
    try:
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{OLD_REV}:operator/specpair_operator/policy/drift.py"],
                             check=True, capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    path = Path(tempfile.mkdtemp()) / "old_drift.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_drift", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_drift"] = mod
    spec.loader.exec_module(mod)
    return mod


def run_old(old, tr: Traffic, hours: float) -> list:
    """What handlers.py did before: lifetime counters summed over pods, a 300 s window
    re-judged at every 30 s sample, unjudged windows after SpeculationOff counted as breaches."""
    eng = Engine(tr, False, False)
    policy = old.DriftPolicy()
    state, samples, events = old.DriftState(), [], []
    now = 0.0
    while now < hours * 3600:
        now += DT
        eng.advance(now)
        samples.append({"t": now, "cats": eng.totals()})
        samples[:] = old.prune_samples(samples, now, policy.window_seconds)
        window = old.windowed_counts(samples, policy.window_seconds)
        breaches, judged = old.judge_window(tr.baseline, window, policy)
        state, action = old.next_step(state, breaches, judged, policy)
        if action:
            events.append((action, now))
            if action == old.SPECULATION_OFF:
                eng.speculating = False
        if action == old.ROLLBACK:
            break
    return events


BASE = drift.DriftPolicy(tolerance=0.3)
POLICIES = [
    # name, policy, engine exports per-request sums, engine exports request counts
    ("new: 300 s, z 2.33, tol 0.3, 20 req, 2 in a row", BASE, True, True),
    ("  same, engine without per-request sums (as vLLM pods are)", BASE, False, True),
    ("  same, without request counts either", BASE, False, False),
    ("new: 120 s windows, 3 in a row", replace(BASE, window_seconds=120, consecutive=3), True, True),
    ("new: tol 0.2 (the default)", drift.DriftPolicy(), True, True),
    ("new: z 1.64 (95%)", replace(BASE, z=1.64), True, True),
    ("new: 10 requests", replace(BASE, min_requests=10), True, True),
    ("new: 1 in a row", replace(BASE, consecutive=1), True, True),
    ("new: probe after 1 quiet window", replace(BASE, probe_after_windows=1), True, True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--hours", type=float, default=2.5)
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args()
    t0 = time.process_time()
    old = load_old()
    runs = [(sc, seed, make_traffic(sc, 1000 * i + seed, args.hours))
            for i, sc in enumerate(SCENARIOS) for seed in range(args.seeds)]
    policies = ([("old: overlapping 300 s windows, absolute tol", None, False, False)] if old else []) + POLICIES
    rows = []
    for name, policy, moments, requests in policies:
        off_false = rb_false = 0
        per_scenario = {}
        for sc, seed, tr in runs:
            ev = run_old(old, tr, args.hours) if policy is None else run_new(tr, policy, args.hours, moments, requests)
            acts = [a for a, _ in ev]
            res = per_scenario.setdefault(sc.name, {"off": [], "rb": [], "false_off": 0, "false_rb": 0, "n": 0})
            res["n"] += 1
            if not sc.drifted:
                res["false_off"] += "SpeculationOff" in acts
                res["false_rb"] += "Rollback" in acts
                off_false += "SpeculationOff" in acts
                rb_false += "Rollback" in acts
            else:
                res["off"].append(next((t - ONSET for a, t in ev if a == "SpeculationOff" and t > ONSET), None))
                res["rb"].append(next((t - ONSET for a, t in ev if a == "Rollback" and t > ONSET), None))
        rows.append((name, off_false, rb_false, per_scenario))
    healthy = [s for s in SCENARIOS if not s.drifted]
    drifted = [s for s in SCENARIOS if s.drifted]
    n_healthy = len(healthy) * args.seeds
    run_hours = args.hours

    def delay(v: list) -> str:
        got = [x for x in v if x is not None]
        if not got:
            return "missed"
        med = float(np.median(got)) / 60
        miss = len(v) - len(got)
        return f"{med:.0f} min" + (f" ({miss}/{len(v)} missed)" if miss else "")

    head = ["policy", f"false off ({n_healthy} healthy runs of {run_hours:g} h)", "false rollback"] + \
        [f"{s.name}: off / rollback" for s in drifted]
    lines = []
    for name, off_false, rb_false, per in rows:
        cells = [name, f"{off_false / n_healthy:.0%}", f"{rb_false / n_healthy:.0%}"]
        cells += [f"{delay(per[s.name]['off'])} / {delay(per[s.name]['rb'])}" for s in drifted]
        lines.append(cells)
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for cells in lines:
            print("| " + " | ".join(cells) + " |")
        print()
        print("False actions per healthy scenario (off/rollback, runs out of " + str(args.seeds) + "):")
        print()
        print("| policy | " + " | ".join(s.name for s in healthy) + " |")
        print("|" + "---|" * (len(healthy) + 1))
        for name, _, _, per in rows:
            print("| " + name + " | " + " | ".join(f"{per[s.name]['false_off']}/{per[s.name]['false_rb']}"
                                                   for s in healthy) + " |")
    else:
        for cells in [head] + lines:
            print(" | ".join(cells))
        print()
        for name, _, _, per in rows:
            print(f"{name}: " + ", ".join(f"{s.name} {per[s.name]['false_off']}/{per[s.name]['false_rb']}"
                                          for s in healthy))
    print(f"\nseeds {args.seeds}, {args.hours:g} h per run, drift from {ONSET / 3600:g} h; CPU {time.process_time() - t0:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
