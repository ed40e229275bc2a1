"""effectiveLoad's divisor (the tokens a step yields) when the pair's live rate window holds no
steps, in Prometheus' own engine (promtool's rule tests over series named and labelled as each
engine exports them). A pair idle longer than the rate window has no live acceptance; the first
seconds of a burst, before Prometheus has scraped a step of it, must read the queue over the
tokens a step yielded in the pair's recent history (HISTORY_WINDOW), not the raw queue: at
production scrape intervals (15-30 s) the raw queue at acceptance length 3 is three times the
load, and KEDA's HPA scales out on its first reading. The history is only for a pair that emitted
nothing in the live window: one emitting without accepted drafts (speculation off) yields one
token a step now, whatever it did an hour ago; a pair with no history at all (brand new) keeps the
one-token fallback (the raw queue: the conservative side, it scales out sooner, never later)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml
from ci_skips import skip_unless_ci

from specpair_operator.crd.autoscaling_signals import HISTORY_WINDOW, RATE_WINDOW
from specpair_operator.desired.autoscaling import query

STEP_S = 15                         # the scrape interval of the series below
NAMES = {"specpair": ("specpair_num_requests_waiting", "specpair_num_emitted_tokens_total",
                      "specpair_num_accepted_tokens_total"),
         "vllm": ("vllm:num_requests_waiting", "vllm:generation_tokens_total",
                  "vllm:spec_decode_num_accepted_tokens_total")}


def _seconds(window: str) -> int:
    return int(window[:-1]) * {"s": 1, "m": 60, "h": 3600}[window[-1]]


HISTORY_STEPS = _seconds(HISTORY_WINDOW) // STEP_S


def _promtool() -> str:
    promtool = shutil.which("promtool", path=os.environ.get("SPECPAIR_PROMETHEUS_BIN"))
    if promtool is None:
        skip_unless_ci("promtool not built here (scripts/build-prometheus.sh; scripts/test.sh builds it)")
    return promtool


def _labels(engine: str, pair: str, pod: str, namespace: str = "team-a", speculating: bool = True) -> str:
    from specpair.vllm_serve import identity_name

    own = (f'pair="{pair}",version="3",engine="specpair",category="general"' if engine == "specpair" else
           f'model_name="{identity_name(pair, "3", "ab" * 32, speculating)}",engine="0"')
    return f'{{namespace="{namespace}",pod="{pod}",{own}}}'


def _values(samples: list[float | str | None]) -> str:
    """promtool's input values, one a scrape (None: no sample, the series absent then; "stale":
    the staleness marker Prometheus writes when a scraped series goes, e.g. with its pod)."""
    return " ".join("_" if v is None else v if isinstance(v, str) else f"{v:g}" for v in samples)


def _ended(samples: list[float | None], at: int) -> list[float | str | None]:
    """The series as scraped until `at`, where its pod went: stale, then absent."""
    return samples[:at] + ["stale"] + [None] * (len(samples) - at - 1)


def _counter(*phases: tuple[int, float | None]) -> list[float | None]:
    """A counter's scrapes: (scrapes, increase a scrape) per phase, from 0; None: absent then."""
    out, total = [], 0.0
    for scrapes, step in phases:
        for _ in range(scrapes):
            if step is None:
                out.append(None)
            else:
                out.append(total)
                total += step
    return out


def _pod(engine: str, pod: str, waiting: list[float | None], emitted: list[float | None],
         accepted: list[float | None] | None, pair: str = "chat", namespace: str = "team-a",
         speculating: bool = True) -> list[dict]:
    labels = _labels(engine, pair, pod, namespace, speculating)
    names = NAMES[engine]
    out = [{"series": names[0] + labels, "values": _values(waiting)},
           {"series": names[1] + labels, "values": _values(emitted)}]
    if accepted is not None:
        out.append({"series": names[2] + labels, "values": _values(accepted)})
    return out


def _noise(engine: str, scrapes: int) -> list[dict]:
    """Another pair's pod and the same pair's in another namespace, emitting all along without
    accepted drafts, with a long queue: counted anywhere in the query (the queue, the live window,
    the `unless`), they would change every reading below."""
    busy = dict(waiting=[50.0] * scrapes, emitted=_counter((scrapes, 300)), accepted=[0.0] * scrapes)
    return _pod(engine, "o0", pair="other", **busy) + _pod(engine, "b0", namespace="team-b", **busy)


def _at(scrape: int) -> str:
    return f"{scrape * STEP_S}s"


def _reads(engine: str, eval_scrape: int, expected: float) -> dict:
    # Compared within 1e-9, not bit for bit: rate() extrapolates.
    return {"expr": f"abs(({query('chat', 'team-a', 'effectiveLoad', engine)}) - {expected!r}) < bool 1e-9",
            "eval_time": _at(eval_scrape), "exp_samples": [{"labels": "{}", "value": 1}]}


def _promtool_test(tmp_path, series: list[dict], checks: list[dict]) -> None:
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    # promtool evaluates a check at its eval_time rounded down to the evaluation interval (1m by
    # default): at the scrape interval, every scrape's reading is its own.
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"],
                                                        "evaluation_interval": f"{STEP_S}s", "tests": [
        {"interval": f"{STEP_S}s", "input_series": series, "promql_expr_test": checks}]}))
    out = subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# Scrapes of one pod in the idle-then-burst story: 10 minutes at 3 tokens a step (300 emitted, 200
# of them accepted drafts, each 15 s) with 2 requests waiting, 10 idle minutes (no queue, counters
# flat), then a burst: 3 waiting from scrape BURST, whose steps are first scraped at BURST + 1.
BUSY, IDLE = 40, 40
BURST = BUSY + IDLE


@pytest.mark.parametrize("engine", ["specpair", "vllm"])
def test_a_burst_after_idle_reads_the_queue_over_the_pair_s_recent_tokens_a_step(engine, tmp_path):
    """Two pods idle 10 minutes (rates 0 in the live window): 6 requests arrive, and until a step
    of them is scraped the load is 6 / 3 = 2 (the pair's last hour: 3 tokens a step), not 6.
    Once the burst's steps are scraped the live window wins: they ran at collapsed acceptance (20
    of 300), so the same queue is 6 / (300 / 280) = 5.6, whatever the history says. Today's query
    (no history) read 6 at the burst."""
    assert _seconds(RATE_WINDOW) < IDLE * STEP_S < _seconds(HISTORY_WINDOW)
    waiting = [2.0] * BUSY + [0.0] * IDLE + [3.0] * 5
    emitted = _counter((BUSY, 300), (IDLE + 1, 0), (4, 300))
    accepted = _counter((BUSY, 200), (IDLE + 1, 0), (4, 20))
    series = [s for pod in ("p0", "p1") for s in _pod(engine, pod, waiting, emitted, accepted)]
    _promtool_test(tmp_path, series + _noise(engine, len(waiting)), [
        _reads(engine, BUSY - 1, 4 / 3),            # busy: the live window, 3 tokens a step
        _reads(engine, BURST - 1, 0.0),             # idle: no queue, no load
        _reads(engine, BURST, 6 / 3),               # the burst, no step of it scraped yet
        _reads(engine, BURST + 3, 6 * 280 / 300)])  # its steps scraped: the live acceptance


@pytest.mark.parametrize("engine", ["specpair", "vllm"])
def test_a_burst_after_an_idle_longer_than_the_history_reads_the_raw_queue(engine, tmp_path):
    """The history is HISTORY_WINDOW long: a pair idle longer than that has none, and a step counts
    one token until the burst's steps are scraped (the conservative side)."""
    idle = HISTORY_STEPS + 20
    waiting = [2.0] * BUSY + [0.0] * idle + [3.0] * 2
    emitted = _counter((BUSY, 300), (idle + 2, 0))
    accepted = _counter((BUSY, 200), (idle + 2, 0))
    series = [s for pod in ("p0", "p1") for s in _pod(engine, pod, waiting, emitted, accepted)]
    _promtool_test(tmp_path, series + _noise(engine, len(waiting)), [_reads(engine, BUSY + idle, 6.0)])


@pytest.mark.parametrize("engine", ["specpair", "vllm"])
def test_a_pair_emitting_without_accepted_drafts_reads_one_token_a_step_not_its_history(engine, tmp_path):
    """Speculation switched off after 10 minutes at 3 tokens a step, 6 requests waiting all along.
    In place (the accepted counter stays, flat): the live window says 1 token a step. By a new pod
    that never speculated (no accepted series at all, as vLLM without a drafter and our engine
    with no drafts export) while the speculating pod is gone: the live window has no ratio, yet
    the pair emitted in it, so its history (3 a step) must not be used either: 6, not 2."""
    off = 8
    emitted = _counter((BUSY + off, 300))
    in_place = _pod(engine, "p0", [6.0] * (BUSY + off), emitted, _counter((BUSY, 200), (off, 0)))
    replaced = (_pod(engine, "p0", _ended([6.0] * (BUSY + off), BUSY), _ended(emitted, BUSY),
                     _ended(_counter((BUSY + off, 200)), BUSY))
                + _pod(engine, "p1", [None] * BUSY + [6.0] * off, _counter((BUSY, None), (off, 300)), None,
                       speculating=False))
    for series in (in_place, replaced):
        _promtool_test(tmp_path, series + _noise(engine, BUSY + off), [
            _reads(engine, BUSY - 1, 2.0),                 # speculating: 3 tokens a step
            _reads(engine, BUSY + off - 1, 6.0)])          # off: the raw queue


@pytest.mark.parametrize("engine", ["specpair", "vllm"])
def test_a_brand_new_pair_reads_the_raw_queue(engine, tmp_path):
    """No history at all: requests wait before the pod's counters exist (made at its first step),
    then with one scrape of them (no rate yet): a step counts one token, the raw queue."""
    waiting = [6.0] * 6
    emitted = [None] * 4 + [0.0, 300.0]
    series = _pod(engine, "p0", waiting, emitted, emitted[:4] + [0.0, 200.0])
    _promtool_test(tmp_path, series + _noise(engine, len(waiting)), [
        _reads(engine, 2, 6.0), _reads(engine, 4, 6.0),
        _reads(engine, 5, 6 / 3)])                          # two scrapes: the live window
