"""Shadow scoring in the operator's plans (plan/release_plan.py, plan/serving_shadow.py, policy/shadow_run.py) as tables: a
passed candidate that differs from the champion only on its draft side is scored on the
champion's pods instead of promoted; the verdict on the pods' evidence promotes it, rejects it,
or waits (and past rollout.shadow.maxSeconds rejects it).

Then recovery: a small model of MLflow, the engine Deployment and its pods (whose GetStats.shadow
is the evidence of the candidate the Deployment mounts) runs the release and serving passes
until nothing is left to do, with the operator killed after each write in turn. Every run ends
where the undisturbed one does, with each action recorded once. Pure: no servers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import random
from collections import Counter
from typing import Any

import pytest

import plan_tables
from plan_tables import CURRENT_TLS, MODEL, NOW, NS, PAIR, TLS, UID, available, kinds, mine, pod_info
from specpair_operator.desired import engine_objects, manifests
from specpair_operator.act import owned
from specpair_operator.release import content as release
from specpair_operator.policy import shadow_run
from specpair_operator.plan import release_steps as rs
from specpair_operator.release.registry_contract import TAG_RELEASE
from specpair_operator.plan import release_plan as p
from specpair_operator.plan import serving_plan as sp
from specpair_operator.observe.serving_world import EnginePod, ServingWorld
from specpair_operator.observe.world import Records

GOOD = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
        "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.4,
        "categories": {"code": {"acceptanceRate": 0.8}, "chat": {"acceptanceRate": 0.6}}}
SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc"}, "draft": {"drafter": "ngram"},
        "rollout": {"replicas": 1}, "drift": {"enabled": False}}
CHAMPION_TAGS = plan_tables.release_tags(SPEC)
DRAFT_ONLY = plan_tables.release_tags({**SPEC, "draft": {"source": "tiny-draft"}})    # only the draft side differs
NEW_TARGET = plan_tables.release_tags({**SPEC, "target": {"source": "HuggingFaceTB/SmolLM2-360M"}})
# v2 passed its gate (its Job reported the verdict); v1 is champion.
candidate_world = functools.partial(plan_tables.candidate_world, tags=DRAFT_ONLY, champion_tags=CHAMPION_TAGS,
                                    verdict=GOOD, rollout={"replicas": 1})


def verdict_tag(result: str, reason: str = "r") -> dict[str, str]:
    return {shadow_run.TAG_SHADOW_STARTED: NOW,
            shadow_run.TAG_SHADOW_VERDICT: shadow_run.verdict_tag({"result": result, "reason": reason, "categories": {}})}


# -- the release's plan: whether a passed candidate is scored in shadow -----------------------------

SCORING = ["Record ShadowStarted", "SetStatus previousVersion,servingVersion", "ServeChampion 1 shadow v2"]
PROMOTION = ["TagVersion v2 specpair.promoted_at", "SetAlias previous=1", "SetAlias champion=2",
             "Record Promoted", "ServeChampion 2"]


@pytest.mark.parametrize("what, w, expected", [
    ("only the draft differs, no strategy named: scored on v1's pods, not promoted",
     candidate_world(), SCORING),
    ("the pods carry it (a pass died before its status): ShadowStarted recorded",
     candidate_world(tags={**DRAFT_ONLY, shadow_run.TAG_SHADOW_STARTED: "2026-11-25T11:00:00Z"}), SCORING),
    ("scoring already recorded: the champion serves with the shadow, nothing else",
     candidate_world(tags={**DRAFT_ONLY, shadow_run.TAG_SHADOW_STARTED: NOW},
                     records=Records({"GateStarted": ("2",), "GatePassed": ("2",), "ShadowStarted": ("2",)})),
     SCORING[1:]),
    ("the verdict is Promote: promoted as a gate pass is, ShadowPromoted recorded (its pass died first)",
     candidate_world(tags={**DRAFT_ONLY, **verdict_tag("Promote")}),
     ["Condition ShadowScored=True Promoted", "SetStatus shadow", "Record ShadowPromoted", *PROMOTION]),
    ("the verdict is Rejected: never promoted, the champion serves without the shadow",
     candidate_world(tags={**DRAFT_ONLY, **verdict_tag("Rejected")}),
     ["Condition ShadowScored=True Rejected", "SetStatus shadow", "Record ShadowRejected",
      "SetStatus previousVersion,servingVersion", "ServeChampion -"]),
    ("another target: a canary on the CRD's default steps beside v1, not promoted yet (issue 57)",
     candidate_world(tags=NEW_TARGET), ["Record CanaryStarted", "SetStatus previousVersion,servingVersion",
                                        "ServeChampion 1 canary v2"]),
    ("rollout.strategy.type Replace: promoted at once",
     candidate_world(rollout={"strategy": {"type": "Replace"}}), PROMOTION),
    ("no champion release to compare with: promoted at once", candidate_world(champion_release=None), PROMOTION),
    ("Shadow asked for a new target: refused, not promoted, the champion keeps serving",
     candidate_world(tags=NEW_TARGET, rollout={"strategy": {"type": "Shadow"}}),
     ["Condition ShadowScored=False ShadowRefused", "Record ShadowRefused",
      "SetStatus previousVersion,servingVersion", "ServeChampion -"]),
])
def test_a_passed_candidate_is_scored_in_shadow_when_only_its_draft_differs(what, w, expected):
    steps = p.plan_release(w)
    tail = kinds(steps)[-len(expected):]
    assert tail == expected, what
    if "ServeChampion 1 canary v2" in expected:
        assert [s.weight for s in steps[-1].canary.steps] == [5, 25, 50, 100]
    if "ServeChampion 1 shadow v2" in expected:
        run = steps[-1].shadow
        assert run.settings == shadow_run.ShadowSettings(0.1, 20, 3600.0)   # the CRD's defaults
        assert run.release == json.loads(DRAFT_ONLY[TAG_RELEASE]) and run.verdict == GOOD
        assert run.started_at == w.tags.get(shadow_run.TAG_SHADOW_STARTED, "")
    if expected[-1] == "ServeChampion -":
        assert "v2" in steps[-1].reason and "keeps serving" in steps[-1].reason or "rejected" in steps[-1].reason


def test_shadow_settings_come_from_the_spec():
    w = candidate_world(rollout={"shadow": {"share": 0.5, "maxSeconds": 60}})
    assert p.plan_release(w)[-1].shadow.settings == shadow_run.ShadowSettings(0.5, 20, 60.0)


# -- the serving plan: the champion's pods score the candidate, the verdict ------------------------

def per_request(candidate: float, champion: float, requests: int, seed: int) -> dict[str, Any]:
    """A category's GetStats.shadow sums (the probe's dict) over `requests` shadowed requests on
    which the champion's first-position alpha is around `champion` and the candidate's, on the
    same request, shifted to around `candidate`."""
    rng = random.Random(seed)
    cand = {"requests": 0, "positions": 0, "alpha": 0.0, "positionsSq": 0.0, "alphaSq": 0.0, "positionsAlpha": 0.0}
    champ = dict(cand)
    cross = {"requests": 0, "acceptedBoth": 0.0, "acceptedDrafted": 0.0, "draftedAccepted": 0.0, "draftedBoth": 0.0}
    for _ in range(requests):
        d = rng.randint(10, 40)
        hard = min(1.0, max(0.0, rng.gauss(champion, 0.1)))
        mine = min(1.0, max(0.0, hard + candidate - champion + rng.gauss(0, 0.03)))
        for side, rate in ((cand, mine), (champ, hard)):
            a = rate * d
            side["requests"] += 1
            side["positions"] += d
            side["alpha"] += a
            side["positionsSq"] += d * d
            side["alphaSq"] += a * a
            side["positionsAlpha"] += d * a
        cross["requests"] += 1
        cross["acceptedBoth"] += mine * d * hard * d
        cross["acceptedDrafted"] += mine * d * d
        cross["draftedAccepted"] += d * hard * d
        cross["draftedBoth"] += d * d
    return {"requests": requests, "candidateAlpha": cand, "championAlpha": champ, "alphaPaired": cross,
            "draftSeconds": 0.01 * requests, "committedTokens": 30 * requests}


BETTER = {"code": (0.75, 0.55), "chat": (0.6, 0.45)}
WORSE_IN_CODE = {"code": (0.35, 0.55), "chat": (0.6, 0.45)}
SHORT = {"code": (0.75, 0.55)}


def shadow_stats(digest: str, rates: dict[str, tuple[float, float]], requests: int = 60,
                 seed: int = 1) -> dict[str, Any]:
    return {"categories": {}, "shadow": {"candidateHash": digest, "candidateVersion": "2", "categories": {
        cat: per_request(c, k, requests, seed + i) for i, (cat, (c, k)) in enumerate(sorted(rates.items()))}}}


def run(started_at: str = NOW, **settings: Any) -> shadow_run.ShadowRun:
    return shadow_run.ShadowRun("2", json.loads(DRAFT_ONLY[TAG_RELEASE]), GOOD, started_at,
                                dataclasses.replace(shadow_run.ShadowSettings(0.1, 20, 3600.0), **settings))


def scoring(rates: dict[str, tuple[float, float]] | None = None, pods: int = 2, requests: int = 60,
            shadow: shadow_run.ShadowRun | None = None, digest: str | None = None, **changes: Any) -> ServingWorld:
    """v1 serving on `pods` pods rendered with v2 in shadow, each reporting `rates` of v2's evidence."""
    w = ServingWorld(pair=PAIR, namespace=NS, uid=UID, model=MODEL, aliases={"champion": "1"}, desired="1",
                     spec=SPEC, status={"engineTLS": CURRENT_TLS}, now=NOW, tags=CHAMPION_TAGS, verdict=GOOD, tls=TLS,
                     shadow=shadow or run())
    dep = available(sp.engine_deployment(w, sp.served_release(w)))
    digest = digest or release.content_hash(sp.shadow_release(w))
    info = pod_info(sp.served_release(w))
    ready = tuple(EnginePod(f"pod{i}", f"u{i}", f"10.0.0.{i}", info,
                            stats=shadow_stats(digest, rates or {}, requests, seed=10 * i) if rates else None)
                  for i in range(pods))
    w = dataclasses.replace(w, deployment=dep, ready=ready,
                            records=Records({"RolloutStarted": (f"1@{sp.template_fingerprint(dep)}",)}),
                            service=mine(engine_objects.engine_service(PAIR, NS, {}), mutable=False),
                            policy=mine(engine_objects.engine_network_policy(PAIR, NS)))
    return dataclasses.replace(w, **changes)


def test_the_champions_pods_mount_the_candidates_release_file_and_score_it():
    w = scoring()
    dep = sp.engine_deployment(w, sp.served_release(w))
    pod = dep["spec"]["template"]
    engine = pod["spec"]["containers"][0]
    assert engine["command"][-4:] == ["--shadow-release", manifests.SHADOW_RELEASE_FILE, "--shadow-share", "0.1"]
    candidate = json.loads(pod["metadata"]["annotations"][manifests.ANN_SHADOW_RELEASE])
    assert candidate["mlflow"]["version"] == "2" and candidate["draft"]["source"] == "tiny-draft"
    items = next(v for v in pod["spec"]["volumes"] if v["name"] == "release")["downwardAPI"]["items"]
    assert [i["path"] for i in items] == ["release.json", "shadow-release.json"]
    # The champion's own release file is the one it served before: its identity holds.
    plain = sp.engine_deployment(dataclasses.replace(w, shadow=None, deployment=None), sp.served_release(w))
    assert plain["spec"]["template"]["metadata"]["annotations"][manifests.ANN_RELEASE] == \
        pod["metadata"]["annotations"][manifests.ANN_RELEASE]
    assert manifests.ANN_SHADOW_RELEASE not in plain["spec"]["template"]["metadata"]["annotations"]
    # The shadow over, its file goes from the live Deployment: a merge patch removes what it sets to null.
    ended = sp.engine_deployment(dataclasses.replace(w, shadow=None), sp.served_release(w))
    assert ended["spec"]["template"]["metadata"]["annotations"][manifests.ANN_SHADOW_RELEASE] is None
    assert "--shadow-release" not in ended["spec"]["template"]["spec"]["containers"][0]["command"]
    assert owned.manifest_fingerprint(ended) == owned.manifest_fingerprint(plain)
    assert sp.template_fingerprint(ended) == sp.template_fingerprint(plain)


@pytest.mark.parametrize("what, live, started", [
    ("the pods do not carry it yet: the start is marked before they roll", "plain", True),
    ("they carry another candidate: likewise", "other", True),
    ("they carry it: nothing to mark", "carrying", False),
    ("they carry it but the mark is gone: marked now", "carrying-unmarked", True),
])
def test_the_start_is_marked_whenever_the_pods_roll_to_carry_the_candidate(what, live, started):
    w = scoring()
    if live == "plain":
        w = dataclasses.replace(w, deployment=available(sp.engine_deployment(dataclasses.replace(
            w, shadow=None, deployment=None), sp.served_release(w))))
    elif live == "other":
        other = dataclasses.replace(run(), version="9", release=json.loads(NEW_TARGET[TAG_RELEASE]))
        w = dataclasses.replace(w, deployment=available(sp.engine_deployment(dataclasses.replace(
            w, shadow=other, deployment=None), sp.served_release(w))))
    elif live == "carrying-unmarked":
        w = dataclasses.replace(w, shadow=run(started_at=""))
    names = kinds(sp.plan_serving(w))
    mark = "TagVersion v2 specpair.shadow.started_at"
    assert (mark in names) == started, what
    if started and live != "carrying-unmarked":
        assert names.index(mark) < names.index("EnsureOwned Deployment")


def test_the_candidate_file_is_tuned_as_it_would_serve():
    tuned = {**GOOD, "bestSpeculation": {"k": 7, "batchSizeThreshold": 3}}
    w = scoring(shadow=dataclasses.replace(run(), verdict=tuned))
    assert sp.shadow_release(w)["speculation"]["k"] == 7
    w = dataclasses.replace(w, spec={**SPEC, "rollout": {"replicas": 1, "applyGateTuning": False}})
    assert sp.shadow_release(w)["speculation"]["k"] == SPEC.get("speculation", {}).get("k", 4)


@pytest.mark.parametrize("what, w, result, tail", [
    ("better on both pods' evidence: the verdict is tagged, then recorded; promoted next pass",
     scoring(BETTER), "Promote",
     ["TagVersion v2 specpair.shadow.verdict", "Condition ShadowScored=True Promoted", "SetStatus shadow",
      "Record ShadowPromoted", "ReportSpeculation ShadowPromoted"]),
    ("worse in one gated category (though better in another): Rejected",
     scoring(WORSE_IN_CODE), "Rejected",
     ["TagVersion v2 specpair.shadow.verdict", "Condition ShadowScored=True Rejected", "SetStatus shadow",
      "Record ShadowRejected", "ReportSpeculation ShadowRejected"]),
    ("too few requests: Undecided, nothing tagged", scoring(BETTER, requests=5), "Undecided",
     ["Condition ShadowScored=Unknown Scoring", "SetStatus shadow", "ReportSpeculation ShadowScoring"]),
    ("no counters yet: Undecided", scoring(None), "Undecided",
     ["Condition ShadowScored=Unknown Scoring", "SetStatus shadow", "ReportSpeculation ShadowScoring"]),
    ("pods scoring another candidate file count for nothing", scoring(BETTER, digest="other"), "Undecided",
     ["Condition ShadowScored=Unknown Scoring", "SetStatus shadow", "ReportSpeculation ShadowScoring"]),
    ("still undecided past maxSeconds: Rejected with the reason",
     scoring(SHORT, requests=5, shadow=run("2026-11-25T11:00:00Z", max_seconds=600)), "Rejected",
     ["TagVersion v2 specpair.shadow.verdict", "Condition ShadowScored=True Rejected", "SetStatus shadow",
      "Record ShadowRejected", "ReportSpeculation ShadowRejected"]),
])
def test_the_verdict_on_the_pods_evidence(what, w, result, tail):
    steps = sp.plan_serving(w)
    assert kinds(steps)[-len(tail):] == tail, what
    status = next(s.fields["shadow"] for s in steps if isinstance(s, rs.SetStatus) and "shadow" in s.fields)
    assert status["result"] == result
    tagged = [s for s in steps if isinstance(s, rs.TagVersion)]
    assert not [s for s in steps if isinstance(s, rs.SetAlias)], "the serving plan never moves an alias for a shadow"
    if result == "Undecided":
        assert not tagged
        return
    verdict = json.loads(tagged[0].tags[shadow_run.TAG_SHADOW_VERDICT])
    assert shadow_run.read_verdict(tagged[0].tags) == verdict and verdict["result"] == result
    record = next(s for s in steps if isinstance(s, rs.Record))
    assert (record.from_version, record.to_version, record.key) == ("1", "2", "2")
    if "maxSeconds" in what:
        assert "rollout.shadow.maxSeconds 600" in verdict["reason"]
        return
    # The numbers per category, as the status and the history entry carry them.
    code = verdict["categories"]["code"]
    assert code["requests"] == 120 and code["status"] == ("better" if result == "Promote" else "worse")
    assert "code: candidate" in record.reason and "over 120 requests" in record.reason
    assert verdict["pods"] == 2 and verdict["draftSecondsPerToken"] == pytest.approx(0.01 / 30, rel=1e-3)


def test_pods_that_cannot_start_with_the_candidate_reject_it_instead_of_rolling_back():
    w = scoring()
    dep = copy.deepcopy(w.deployment)
    dep["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                    "message": "ReplicaSet has timed out progressing"}]
    steps = sp.plan_serving(dataclasses.replace(w, deployment=dep))
    assert kinds(steps)[-5:] == ["TagVersion v2 specpair.shadow.verdict", "Condition ShadowScored=True Rejected",
                                 "SetStatus shadow", "Record ShadowRejected", "Report stalled Degraded/ShadowRejected"]
    assert not [s for s in steps if isinstance(s, rs.TagVersion) and "specpair.rolled_back" in s.tags]


# -- converging from a crash after any write --------------------------------------------------------

def merge_patched(manifest: dict[str, Any]) -> dict[str, Any]:
    """The Deployment as the API server keeps it after a merge patch: annotations set to null gone."""
    out = copy.deepcopy(manifest)
    meta = out["spec"]["template"]["metadata"]
    meta["annotations"] = {k: v for k, v in meta["annotations"].items() if v is not None}
    return out


class Cluster(plan_tables.CandidateCluster):
    """MLflow (aliases, tags), the engine's objects, and pods that report the shadow evidence of
    whichever candidate their Deployment mounts (`rates`: the candidate's and the champion's
    live alpha per category). The Deployment controller makes each rollout available at once."""

    candidate_world = staticmethod(candidate_world)

    def __init__(self, rates: dict[str, tuple[float, float]]):
        super().__init__(CHAMPION_TAGS, DRAFT_ONLY)
        self.rates = rates

    def serving_world(self, step: rs.ServeChampion) -> ServingWorld:
        w = self.champion_world(step, SPEC, GOOD, shadow=step.shadow, deployment=self.objects.get("Deployment"))
        dep = self.objects.get("Deployment")
        if dep is None:
            return w
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        info = pod_info(json.loads(annotations[manifests.ANN_RELEASE]))
        stats = None
        if manifests.ANN_SHADOW_RELEASE in annotations:
            candidate = json.loads(annotations[manifests.ANN_SHADOW_RELEASE])
            stats = shadow_stats(release.content_hash(candidate), self.rates)
        return dataclasses.replace(w, ready=(EnginePod("pod0", "u0", "10.0.0.1", info, stats=stats),))

    def write_object(self, step: Any) -> None:
        if isinstance(step, sp.EnsureOwned):
            obj = mine(dict(step.manifest), step.mutable)
            if obj["kind"] == "Deployment":
                self.generation += 1
                obj = available(merge_patched(dict(step.manifest)), self.generation)
            self.objects[obj["kind"]] = obj


def converge(rates: dict[str, tuple[float, float]], crash_at: int | None = None) -> Cluster:
    cluster = Cluster(rates)
    for _ in range(20):
        if not cluster.one_pass(crash_at):
            return cluster
    raise AssertionError(f"no convergence: {cluster.history}")


@pytest.mark.parametrize("rates, ends", [(BETTER, "Promote"), (WORSE_IN_CODE, "Rejected")])
def test_shadow_scoring_converges_from_a_crash_after_any_write(rates, ends):
    undisturbed = converge(rates)
    final = json.loads(undisturbed.tags["2"][shadow_run.TAG_SHADOW_VERDICT])["result"]
    assert final == ends
    promoted = ends == "Promote"
    assert undisturbed.aliases["champion"] == ("2" if promoted else "1")
    dep = undisturbed.objects["Deployment"]["spec"]["template"]
    assert manifests.ANN_SHADOW_RELEASE not in dep["metadata"]["annotations"], "the shadow is off at the end"
    assert json.loads(dep["metadata"]["annotations"][manifests.ANN_RELEASE])["mlflow"]["version"] == \
        undisturbed.aliases["champion"]
    actions = Counter(a for a, _ in undisturbed.history)
    assert actions["ShadowStarted"] == 1 and actions["ShadowPromoted" if promoted else "ShadowRejected"] == 1
    assert actions["Promoted"] == (1 if promoted else 0)
    for crash_at in range(undisturbed.writes):
        crashed = converge(rates, crash_at)
        assert crashed.aliases == undisturbed.aliases, crash_at
        assert {v: {k: t for k, t in tags.items() if k != shadow_run.TAG_SHADOW_VERDICT}
                for v, tags in crashed.tags.items()} == \
            {v: {k: t for k, t in tags.items() if k != shadow_run.TAG_SHADOW_VERDICT}
             for v, tags in undisturbed.tags.items()}, crash_at
        assert crashed.objects["Deployment"]["spec"]["template"] == dep, crash_at
        assert sorted(set(crashed.history)) == sorted(crashed.history), f"recorded twice (crash at {crash_at})"
        assert Counter(a for a, _ in crashed.history) == actions, crash_at


def test_the_probes_plain_dict_reads_as_the_message_does():
    """GetStats.shadow through the probe's dict (engine_probe.shadow_stats, shadow_run.evidence)
    gives the evidence shadow_verdict reads from the message itself."""
    from specpair._proto import engine_pb2

    from specpair_operator.clients.engine_probe import shadow_stats
    from specpair_operator.policy.shadow_verdict import ShadowEvidence

    msg = engine_pb2.ShadowStats(candidate_version="2", candidate_content_hash="h", share=0.5, skipped_steps=3)
    cat = msg.categories["code"]
    cat.requests = 7
    cat.candidate_alpha.CopyFrom(engine_pb2.AlphaSums(requests=7, positions=90, alpha=41.5, positions_sq=1300.0,
                                                      alpha_sq=260.25, positions_alpha=580.0))
    cat.champion_alpha.CopyFrom(engine_pb2.AlphaSums(requests=7, positions=88, alpha=30.25, positions_sq=1200.0,
                                                     alpha_sq=140.0, positions_alpha=400.0))
    cat.alpha_paired.CopyFrom(engine_pb2.PairedSums(requests=7, accepted_both=190.0, accepted_drafted=570.0,
                                                    drafted_accepted=410.0, drafted_both=1250.0))
    cat.draft_seconds, cat.committed_tokens = 0.5, 100
    plain = shadow_stats(msg)
    found, pods, seconds, tokens = shadow_run.evidence([{"shadow": plain}, {"shadow": {**plain, "candidateHash": "x"}},
                                                        None], "h")
    assert (pods, seconds, tokens) == (1, 0.5, 100)
    assert found == {"code": ShadowEvidence.from_message(cat)}
    # Without the cross sums (an engine that does not send them) the verdict falls back to unpaired.
    cat.ClearField("alpha_paired")
    found, *_ = shadow_run.evidence([{"shadow": shadow_stats(msg)}], "h")
    assert found["code"].paired is None and ShadowEvidence.from_message(cat).paired is None


def converge_killed_at_every_write(rates: dict[str, tuple[float, float]]) -> Cluster:
    """The operator killed right after every write it makes (each pass dies at its first write;
    only a pass that writes nothing gets its status written), until nothing is left to do."""
    cluster = Cluster(rates)
    for _ in range(60):
        if not cluster.one_pass(cluster.writes):
            return cluster
    raise AssertionError(f"no convergence: a write redone at every pass ({cluster.history}, {cluster.tags['2']})")


@pytest.mark.parametrize("rates, ends", [(BETTER, "Promote"), (WORSE_IN_CODE, "Rejected")])
def test_shadow_scoring_converges_when_killed_after_every_write(rates, ends):
    """The start's mark is made for the pods' roll it stands for: killed after it, the next pass
    rolls them instead of marking again; a promotion whose every write was killed still records
    the verdict (ShadowPromoted, status.shadow) with it."""
    undisturbed = converge(rates)
    crashed = converge_killed_at_every_write(rates)
    assert crashed.aliases == undisturbed.aliases
    assert crashed.objects["Deployment"]["spec"]["template"] == undisturbed.objects["Deployment"]["spec"]["template"]
    assert sorted(set(crashed.history)) == sorted(crashed.history), "recorded twice"
    assert Counter(a for a, _ in crashed.history) == Counter(a for a, _ in undisturbed.history)
    assert crashed.status["shadow"]["result"] == ends and crashed.status["shadow"]["version"] == "2"
    assert crashed.status["shadow"]["categories"] == undisturbed.status["shadow"]["categories"]


@pytest.mark.parametrize("what, generation, marked", [
    ("marked for this very roll (its pass died right after the mark): rolled, not marked again", 1, False),
    ("marked for a roll to the same pods before (the spec left the candidate and came back): marked again", 3, True),
])
def test_the_start_is_marked_once_per_roll(what, generation, marked):
    w = scoring()
    plain = available(sp.engine_deployment(dataclasses.replace(w, shadow=None, deployment=None), sp.served_release(w)),
                      generation)
    w = dataclasses.replace(w, deployment=plain)
    template = sp.engine_deployment(w, sp.served_release(w))["metadata"]["annotations"][sp.ANN_TEMPLATE]
    mark_roll = shadow_run.rolled_to(template, {"metadata": {"generation": 1}})
    w = dataclasses.replace(w, shadow=dataclasses.replace(run(), started_for=mark_roll))
    names = kinds(sp.plan_serving(w))
    mark = "TagVersion v2 specpair.shadow.started_at"
    assert (mark in names) == marked, what
    assert "EnsureOwned Deployment" in names
    if marked:
        tag = next(s for s in sp.plan_serving(w) if isinstance(s, rs.TagVersion))
        assert shadow_run.read_started(tag.tags) == (NOW, shadow_run.rolled_to(template, plain))
