"""`specpair distill --from-capture DIR --category C` on tiny models: a drafter trained on one
category's captured requests (prompt and the target's own reply token ids), measured on the
release's golden prompts of that category, loaded as a drafter; no data is refused by name."""

from __future__ import annotations

import json
import re

import pytest

from specpair.cli import main
from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.distill import DistillConfig, distill
from specpair.distill_capture import captured_conversations, golden_prompts
from specpair.errors import SpecpairError
from specpair.models import load_model

from capture_data import EXTRACTION, extraction_prompts, write_capture   # tests/ is on sys.path

@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("capture")
    write_capture(root, SpeculativeEngine(tiny_target, check_tokenizers=False),
                  {"extraction": extraction_prompts(24), "qa": ["What is a tuple?", "Why does Python indent?"]})
    return root


def _release(tmp_path) -> str:
    path = tmp_path / "release.json"
    path.write_text(json.dumps({"gating": {"prompts": [
        {"prompt": EXTRACTION[0].format("def fill(text, width=70):\n    return text"), "category": "extraction"},
        {"prompt": EXTRACTION[1].format("name = 'shorten'; mode = \"wrap\""), "category": "extraction"},
        {"prompt": "What is a list?", "category": "qa"}]}}))
    return str(path)


def test_distill_from_capture_trains_a_drafter_for_the_category_that_loads(tmp_path, tiny_target, capture_dir):
    out = tmp_path / "draft"
    config = DistillConfig(out=str(out), steps=200, batch_size=4, seq_len=48, layers=1, hidden=64, heads=4,
                           lr=3e-3, seed=3, checkpoint_every=50, eval_prompts=4, eval_tokens=24,
                           init="truncate", from_capture=str(capture_dir), category="extraction",
                           golden_release=_release(tmp_path))
    summary = distill(config, teacher=tiny_target, progress=lambda *_: None)
    capture = summary["capture"]
    assert capture["category"] == "extraction" and capture["requests"] == 24, capture
    assert capture["releases"] == ["3"] and capture["tokenizers"] == ["tok-sha"], capture
    assert capture["first"] == 1000 and capture["last"] == 1023, capture
    assert summary["loss_last10"] < 0.7 * summary["loss_first10"], summary
    # Measured on the release's golden prompts of the category (2 of them), chat-formatted.
    assert summary["acceptance_after"] > summary["acceptance_before"], summary
    # The output loads as a drafter for this target: greedy speculative output equals target-only.
    draft = load_model(str(out), device="cpu")
    engine = SpeculativeEngine(tiny_target, draft=draft, speculation=SpeculationConfig(k=4, fallback_threshold=0.0))
    prompts = golden_prompts(_release(tmp_path), "extraction")[0]
    params = GenerationParams(max_new_tokens=24)
    spec = engine.generate(prompts, params, chat=True)
    plain = engine.generate(prompts, params, chat=True, speculate=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.stats.num_accepted_tokens for r in spec) > 0
    saved = json.loads((out / "distill_summary.json").read_text())
    assert saved["capture"] == capture and saved["config"]["category"] == "extraction"


def test_capture_reading_skips_a_cut_line_and_refuses_bad_input(tmp_path, capture_dir):
    from specpair.capture import complete_name
    from specpair.distill_capture import read_capture

    conversations = captured_conversations(str(capture_dir), "qa")
    assert [c["time"] for c in conversations] == [1024, 1025]
    assert all(c["ids"] and c["features"] is None for c in conversations)
    with pytest.raises(SpecpairError, match=r"no captured requests of category 'code'.*extraction, qa"):
        captured_conversations(str(capture_dir), "code")
    with pytest.raises(SpecpairError, match="no such directory"):
        captured_conversations(str(tmp_path / "missing"), "qa")
    with pytest.raises(SpecpairError, match="not a category name"):
        captured_conversations(str(capture_dir), "../qa")
    cut = tmp_path / "cut" / "qa"
    cut.mkdir(parents=True)
    whole = json.dumps({"v": 1, "category": "qa", "prompt_ids": [1, 2], "reply_ids": [3], "release": "1",
                        "time": 5})
    (cut / complete_name(10.0, "engine-0", 1, 2)).write_text(whole + "\n" + whole[:20] + "\n")  # cut by a kill
    conversations, skipped = read_capture(str(tmp_path / "cut"), "qa")
    assert (len(conversations), skipped) == (1, 1)
    (cut / complete_name(11.0, "engine-0", 2, 1)).write_text(
        json.dumps({"v": 1, "category": "qa", "prompt_ids": [1, -2], "reply_ids": [3]}) + "\n")
    with pytest.raises(SpecpairError, match="prompt_ids must be a list of token ids"):
        captured_conversations(str(tmp_path / "cut"), "qa")


def test_distill_from_capture_refusals(tmp_path, tiny_target, capture_dir, capsys):
    with pytest.raises(SpecpairError, match="go together"):
        DistillConfig(out=str(tmp_path / "x"), from_capture=str(capture_dir))
    with pytest.raises(SpecpairError, match="--replies and --requests do not apply"):
        DistillConfig(out=str(tmp_path / "x"), from_capture=str(capture_dir), category="qa", replies=4)
    # Two short requests make fewer tokens than one training window.
    with pytest.raises(SpecpairError, match=r"category 'qa' hold \d+ tokens: training windows need more than 257"):
        distill(DistillConfig(out=str(tmp_path / "x"), seq_len=256, from_capture=str(capture_dir), category="qa"),
                teacher=tiny_target, progress=lambda *_: None)
    # The CLI says it and exits non-zero before loading any model.
    rc = main(["distill", "--from-capture", str(capture_dir), "--category", "code", "--out", str(tmp_path / "y"),
               "--target", str(tmp_path / "no-such-model")])
    assert rc == 2
    assert "no captured requests of category 'code'" in capsys.readouterr().err
    assert not (tmp_path / "y" / "distill_summary.json").exists()


@pytest.mark.parametrize("content, said", [(None, "no such file"), ("{'gating': 1", r"not JSON \(.*line 1\)"),
                                           ("[1, 2]", r"not a release \(a JSON object\)"),
                                           (b"\xff\xfe{}", "cannot be read")])
def test_a_bad_release_file_is_refused_by_its_flag_by_the_gate_and_the_golden_prompts(tmp_path, content, said):
    """One reader (config.read_release_file) for the gate's --release and distillation's
    --golden-release: each refusal names the flag and the file, before any model loads."""
    from specpair.gate import run_gate_file

    path = tmp_path / "release.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SpecpairError, match=f"^--golden-release {re.escape(str(path))}: {said}"):
        golden_prompts(str(path), "qa")
    with pytest.raises(SpecpairError, match=f"^--release {re.escape(str(path))}: {said}"):
        run_gate_file(str(path), str(tmp_path / "verdict.json"), progress=lambda *_: None)
    assert not (tmp_path / "verdict.json").exists()
    assert golden_prompts(_release(tmp_path), "qa") == (["What is a list?"], True)


def test_the_format_a_category_was_served_in_is_told_from_its_captured_prompts(tmp_path, tiny_target, capture_dir):
    """Chat-formatted or plain completions, from the prompt ids alone (the chat template's lead):
    the learned release's gate scores the category's golden prompts in the format it was served in."""
    from specpair.distill_capture import chat_lead, chat_share

    tok = tiny_target.tokenizer
    lead = chat_lead(tok)
    assert lead and lead == SpeculativeEngine(tiny_target, check_tokenizers=False).encode("x", chat=True)[:len(lead)]
    assert chat_share(tok, captured_conversations(str(capture_dir), "extraction")) == 1.0
    plain = tmp_path / "plain"
    write_capture(plain, SpeculativeEngine(tiny_target, check_tokenizers=False),
                  {"extraction": extraction_prompts(6)}, chat=False, max_new_tokens=8)
    assert chat_share(tok, captured_conversations(str(plain), "extraction")) == 0.0
    mixed = captured_conversations(str(plain), "extraction")[:3] + \
        captured_conversations(str(capture_dir), "extraction")[:1]
    assert chat_share(tok, mixed) == 0.25
    assert chat_share(tok, []) is None
