"""spec.learning in the engine's manifests (issue 58, docs/learning.md): a pair that captures its
traffic has its engine pods mount the claim it names and run with the capture flags, which the
engine's own command line reads back as the spec's settings; a pair that does not (every pair
until it opts in) renders exactly what it rendered before, so adding the field rolls no pod."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from plan_tables import PAIR, kinds
from specpair import capture
from specpair.server.cli import add_engine_parser, server_options
from specpair_operator.crd.schema import spec_schema
from specpair_operator.crd.validation import validate_spec
from specpair_operator.desired import learning
from specpair_operator.plan import serving_plan as sp
from test_operator_serving_plan import SPEC, base, serving

LEARNING = {"enabled": True, "persistentVolumeClaim": "traffic", "sampleRate": 0.25, "perCategoryCap": 500,
            "retentionSeconds": 86400}


def engine_container(dep):
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


def rendered(spec) -> dict:
    w = base(spec=spec)
    return sp.engine_deployment(w, sp.served_release(w))


def test_a_capturing_pair_mounts_its_claim_and_the_engine_reads_the_flags_as_the_spec_says():
    dep = rendered({**SPEC, "learning": LEARNING})
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "capture", "persistentVolumeClaim": {"claimName": "traffic"}} in pod["volumes"]
    engine = engine_container(dep)
    assert {"name": "capture", "mountPath": learning.CAPTURE_MOUNT_PATH} in engine["volumeMounts"]
    # The pod's command as the engine parses it (its own parser): the spec's settings, in the pair's folder.
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["engine", *engine["command"][engine["command"].index("serve"):]])
    settings = server_options(args).capture
    assert (settings.directory, settings.sample_rate, settings.per_category_cap, settings.retention_seconds) == \
        (f"{learning.CAPTURE_MOUNT_PATH}/{PAIR}", 0.25, 500, 86400)


def test_absent_settings_take_the_engines_defaults_written_out():
    lr = learning.Learning.from_spec({"learning": {"enabled": True, "persistentVolumeClaim": "traffic"}})
    assert learning.capture_flags("p", lr) == [
        "--capture-dir", f"{learning.CAPTURE_MOUNT_PATH}/p", "--capture-rate", f"{capture.DEFAULT_SAMPLE_RATE:g}",
        "--capture-cap", str(capture.DEFAULT_PER_CATEGORY_CAP),
        "--capture-retention", str(capture.DEFAULT_RETENTION_SECONDS)]
    assert learning.Learning.from_spec({}) == learning.Learning(
        enabled=False, sample_rate=capture.DEFAULT_SAMPLE_RATE, per_category_cap=capture.DEFAULT_PER_CATEGORY_CAP,
        retention_seconds=capture.DEFAULT_RETENTION_SECONDS, claim=None, keep_on_delete=False)


@pytest.mark.parametrize("given", [None, {}, {"enabled": False, "keepOnDelete": False},
                                   {"enabled": False, "persistentVolumeClaim": "traffic", "sampleRate": 0.5}])
def test_a_pair_that_does_not_capture_renders_what_it_rendered_before(given):
    spec = {**SPEC, **({} if given is None else {"learning": given})}
    assert rendered(spec) == rendered(SPEC)
    assert "--capture-dir" not in engine_container(rendered(spec))["command"]


def test_turning_capture_on_is_a_rollout_and_the_same_release():
    w = serving()
    on = dataclasses.replace(w, spec={**SPEC, "learning": LEARNING})
    assert sp.served_release(on) == sp.served_release(w)          # no new release, no gate
    assert "Record RolloutStarted" in kinds(sp.plan_serving(on))  # new pods, with the volume


def test_vllm_pods_capture_nothing():
    w = base(spec={**SPEC, "learning": LEARNING})
    served = {**sp.served_release(w), "engine": {"kind": "vllm"}}
    dep = sp.engine_deployment(w, sp.served_release(w))
    assert learning.with_capture(dep, PAIR, w.spec, served) is dep


def test_the_crds_bounds_are_the_engines_and_its_defaults_are_off():
    props = spec_schema()["properties"]["learning"]["properties"]
    assert (props["perCategoryCap"]["minimum"], props["perCategoryCap"]["maximum"]) == (1, capture.MAX_PER_CATEGORY_CAP)
    assert (props["retentionSeconds"]["minimum"], props["retentionSeconds"]["maximum"]) == \
        (capture.MIN_RETENTION_SECONDS, capture.MAX_RETENTION_SECONDS)
    assert learning.learning_crd_defaults() == {"enabled": False, "keepOnDelete": False}
    # Capture's defaults live in the engine (specpair.capture), not in the CRD: one home.
    assert not any("default" in props[k] for k in ("sampleRate", "perCategoryCap", "retentionSeconds"))


@pytest.mark.parametrize("given, words", [
    ({"enabled": True}, "learning.enabled needs learning.persistentVolumeClaim"),
    ({"sampleRate": 0}, "learning.sampleRate must be above 0 and at most 1"),
    ({"sampleRate": 1.5}, "learning.sampleRate must be above 0 and at most 1"),
    ({"perCategoryCap": 0}, "greater than or equal to 1"),
    ({"retentionSeconds": 10}, "greater than or equal to 60"),
    ({"persistentVolumeClaim": "../x"}, "should match"),
])
def test_the_operator_refuses_what_the_crd_refuses(given, words):
    errors = validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "learning": given})
    assert any(words in e for e in errors), errors
    assert validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "learning": LEARNING}) == []


def test_the_release_never_carries_learning():
    w = base(spec={**SPEC, "learning": LEARNING})
    assert "learning" not in json.dumps(sp.served_release(w))
