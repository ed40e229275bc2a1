"""`specpair gate` on tiny models: verdict contract, thresholds, tokenizer refusal before loading."""

from __future__ import annotations

import json
import subprocess
import sys


from specpair.contract import threshold_failures
from specpair.gate import run_gate

PROMPTS = [{"prompt": "def foo(x):\n    return", "category": "code"},
           {"prompt": "import os\nimport sys\n", "category": "code"},
           {"prompt": "The quick brown fox", "category": "qa"}]


def _release(dirs, **gating):
    return {"pair": "tiny", "target": {"source": dirs["target"]}, "draft": {"source": dirs["draft"]},
            "speculation": {"k": 3, "dynamicK": False},
            "gating": {"prompts": PROMPTS, "maxNewTokens": 16, "chat": False,
                       "thresholds": gating or {"requireGreedyIdentity": True}}}


def test_gate_passes_and_reports_everything(tiny_pair_dirs):
    verdict, golden = run_gate(_release(tiny_pair_dirs), device="cpu", progress=lambda *_: None,
                               k_sweep=[1, 2], batch_sizes=[1, 2])
    assert verdict["passed"] and verdict["reasons"] == []
    assert verdict["greedyIdentity"] == 1.0
    assert verdict["tokenizer"]["compatible"] and verdict["tokenizer"]["draftFingerprint"]
    assert set(verdict["categories"]) == {"code", "qa"}
    assert 0 < verdict["acceptanceRate"] < 1
    assert verdict["meanAcceptanceLength"] > 1
    assert [row["k"] for row in verdict["kSweep"]] == [1, 2, 3]
    assert verdict["bestSpeculation"]["k"] in (1, 2, 3)
    assert len(golden) == 3 and all(g["identical"] for g in golden)
    # Per prompt, what the gate run's table shows: output tokens and the prompt's own speedup.
    assert all(g["output_tokens"] == len(g["token_ids"]) and g["speedup"] > 0 for g in golden)


def test_the_releases_tuning_chooses_the_sweeps(tiny_pair_dirs):
    """gating.tuning: an empty list skips its sweep and nothing is reported for it (serving keeps
    the spec's setting); the spec's k joins the k values swept. The pair names its speedup floor
    (0: none), or the default one would ship this slow tiny pair with speculation off
    (bestSpeculation.batchSizeThreshold 0: test_engine_gate_default_floor.py)."""
    rel = _release(tiny_pair_dirs, requireGreedyIdentity=True, minSpeedup=0)
    rel["gating"]["tuning"] = {"kValues": [], "batchSizes": []}
    verdict, _ = run_gate(rel, device="cpu", progress=lambda *_: None)
    assert verdict["passed"] and verdict["kSweep"] == [] and verdict["batchSweep"] == []
    assert verdict["bestSpeculation"] is None
    rel["gating"]["tuning"] = {"kValues": [2], "batchSizes": []}
    verdict, _ = run_gate(rel, device="cpu", progress=lambda *_: None)
    assert [row["k"] for row in verdict["kSweep"]] == [2, 3] and verdict["batchSweep"] == []
    assert set(verdict["bestSpeculation"]) == {"k"} and verdict["bestSpeculation"]["k"] in (2, 3)


def test_thresholds_say_by_how_much():
    verdict = {"greedyIdentity": 0.5, "acceptanceRate": 0.3, "speedup": 0.9,
               "categories": {"code": {"acceptanceRate": 0.2}}}
    reasons = threshold_failures(verdict, {"minAcceptance": 0.4, "minCategoryAcceptance": {"code": 0.5, "qa": 0.1},
                                           "minSpeedup": 1.2})
    # One wording, shared with the operator (specpair.contract): each failure is said once.
    assert reasons == [
        "greedy identity 0.500 < 1.000 (required: speculative output must equal target-only)",
        "acceptance 0.300 < minAcceptance 0.400 (short by 0.100)",
        "category 'code' acceptance 0.200 < 0.500 (short by 0.300)",
        "category 'qa' acceptance missing (no golden prompt in that category?) < 0.100",
        "speedup 0.900x < minSpeedup 1.200x (short by 0.300x)"]
    from specpair_operator.gate.verdict import evaluate_verdict
    outcome = evaluate_verdict({**verdict, "passed": False, "reasons": reasons},
                               {"minAcceptance": 0.4, "minCategoryAcceptance": {"code": 0.5, "qa": 0.1}, "minSpeedup": 1.2})
    assert outcome.failures == reasons


def test_gate_cli_refuses_other_tokenizer_before_loading_weights(tmp_path, tiny_pair_dirs):
    from tiny_models import make_model, make_tokenizer, save_tiny
    other = save_tiny(make_model(make_tokenizer(vocab_size=350), seed=4), tmp_path / "other")
    # Remove the weights: the gate must decide from tokenizer files alone.
    for f in (tmp_path / "other").glob("*.safetensors"):
        f.unlink()
    release = _release(tiny_pair_dirs)
    release["draft"] = {"source": other}
    (tmp_path / "release.json").write_text(json.dumps(release))
    out = tmp_path / "verdict.json"
    proc = subprocess.run([sys.executable, "-m", "specpair", "gate", "--release",
                           str(tmp_path / "release.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(out.read_text())
    assert verdict["passed"] is False
    assert verdict["reasons"][0].startswith("tokenizer mismatch: vocabulary sizes differ: draft 350 vs target 400")
    assert verdict["tokenizer"]["compatible"] is False


def test_gate_cli_bad_release_is_a_clear_error(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"target": {"source": "x"}, "draft": {},
                                                 "gating": {"prompts": []}}))
    proc = subprocess.run([sys.executable, "-m", "specpair", "gate", "--release", str(tmp_path / "r.json"),
                           "--out", str(tmp_path / "v.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "release.draft needs 'source'" in proc.stderr and "Traceback" not in proc.stderr


# -- golden prompts that ask for structure (gate/structured.py) ---------------------------------

ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"enum": ["yes", "no"]}}}
JSON_PROMPTS = [{"prompt": f"Is {n} even? Answer in JSON.", "category": "json",
                 "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}
                for n in (3, 8)] + [{"prompt": "The quick brown fox", "category": "prose"}]


def test_the_gate_refuses_a_release_whose_golden_json_stops_validating(tiny_pair_dirs):
    """The same golden JSON prompts: with room for the reply they validate and the gate passes;
    with too few tokens to close the object they stop validating, and the gate refuses it by
    the schema-validity floor (the default 1.0), the category and the rate named."""
    rel = _release(tiny_pair_dirs)
    rel["gating"].update(prompts=JSON_PROMPTS, maxNewTokens=48, tuning={"kValues": [], "batchSizes": []})
    verdict, golden = run_gate(rel, device="cpu", progress=lambda *_: None)
    assert verdict["passed"], verdict["reasons"]
    assert verdict["categories"]["json"]["schemaValidity"] == 1.0 and verdict["schemaValidity"] == 1.0
    assert "schemaValidity" not in verdict["categories"]["prose"]     # it asked for none
    replies = [g for g in golden if g["category"] == "json"]
    assert all(json.loads(g["speculative"])["answer"] in ("yes", "no") and g["schema_valid"] for g in replies)
    assert all(g["identical"] for g in golden) and verdict["acceptanceRate"] is not None
    assert "schema_valid" not in golden[-1]

    rel["gating"]["maxNewTokens"] = 3          # '{"answer": ...' cannot close in 3 tokens
    verdict, golden = run_gate(rel, device="cpu", progress=lambda *_: None)
    assert not verdict["passed"]
    assert verdict["categories"]["json"]["schemaValidity"] == 0.0
    assert "category 'json' schema validity 0.000 < minSchemaValidity 1.000 (short by 1.000)" in verdict["reasons"]
    assert not any(g["schema_valid"] for g in golden if g["category"] == "json")

    # A floor the pair lowers is the one held.
    rel["gating"]["thresholds"] = {"minSchemaValidity": 0.0}
    assert run_gate(rel, device="cpu", progress=lambda *_: None)[0]["passed"]


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}}


def test_golden_tool_prompts_are_judged_by_their_calls(tmp_path, tiny_target, tiny_draft):
    """A forced call (tool_choice required) parses into a call the tool accepts; an `auto` one on
    a random model does not call, and the tool-call parse floor says so."""
    import dataclasses
    from tiny_models import make_tokenizer, save_tiny
    tok = make_tokenizer(chat_template=TOOLS_TEMPLATE)
    dirs = {"target": save_tiny(dataclasses.replace(tiny_target, tokenizer=tok), tmp_path / "t"),
            "draft": save_tiny(dataclasses.replace(tiny_draft, tokenizer=tok), tmp_path / "d")}
    rel = _release(dirs)
    ask = {"prompt": "Weather in Oslo?", "category": "tools", "tools": [WEATHER]}
    rel["gating"].update(prompts=[{**ask, "tool_choice": "required"}], chat=True, maxNewTokens=48,
                         tuning={"kValues": [], "batchSizes": []})
    verdict, golden = run_gate(rel, device="cpu", progress=lambda *_: None)
    assert verdict["passed"], verdict["reasons"]
    assert verdict["categories"]["tools"]["toolCallParse"] == 1.0 and golden[0]["tool_call_parsed"]
    assert golden[0]["speculative"].startswith('<tool_call>\n{"name":"get_weather"')

    rel["gating"]["prompts"] = [{**ask, "tool_choice": "auto"}]
    verdict, golden = run_gate(rel, device="cpu", progress=lambda *_: None)
    assert golden[0]["tool_call_parsed"] is False and not verdict["passed"]
    assert "category 'tools' tool-call parse rate 0.000 < minToolCallParse 1.000 (short by 1.000)" in verdict["reasons"]


def test_a_bad_structured_golden_prompt_is_refused_naming_its_field(tiny_pair_dirs):
    import re

    import pytest
    from specpair.errors import SpecpairError
    for prompt, words in [
            ({"response_format": {"type": "xml"}}, "gating.prompts[0].response_format.type: must be text"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
             "gating.prompts[0].response_format.json_schema.schema: does not compile"),
            ({"tool_choice": "required"}, "gating.prompts[0].tool_choice: needs tools"),
            ({"tools": [WEATHER]}, "gating.prompts[0].tools: tools are rendered by the chat template")]:
        rel = _release(tiny_pair_dirs)
        rel["gating"]["prompts"] = [{"prompt": "x", **prompt}]
        with pytest.raises(SpecpairError, match=re.escape(words)):
            run_gate(rel, device="cpu", progress=lambda *_: None)


def test_a_golden_prompt_that_says_its_format_is_scored_in_it(tiny_pair_dirs):
    """A learned release's golden prompts of its category carry the format that category was
    served in (`chat`, training_runner.learned_release): the gate decodes each as it says, the
    others as gating.chat says."""
    from specpair.config import GenerationParams
    from specpair.decoding import SpeculativeEngine
    from specpair.models import load_model

    text = "def foo(x):\n    return"
    rel = _release(tiny_pair_dirs)
    rel["gating"]["maxNewTokens"] = 8
    rel["gating"]["prompts"] = [{"prompt": text, "category": "code"},
                                {"prompt": text, "category": "code", "chat": True}]
    _, golden = run_gate(rel, device="cpu", progress=lambda *_: None, k_sweep=[1], batch_sizes=[1])
    engine = SpeculativeEngine(load_model(tiny_pair_dirs["target"], device="cpu", dtype="float32"),
                               check_tokenizers=False)
    params = GenerationParams(max_new_tokens=8)
    plain, chat = (engine.generate([text], params, chat=c, speculate=False)[0].token_ids for c in (False, True))
    assert plain != chat           # the two formats get different replies from this target
    assert [g["token_ids"] for g in golden] == [plain, chat]
