"""One way to build a pair: every entry point (specpair generate, specpair bench, the engine
server with flags or a release, the gate) hands its pair to pair.load_pair, the same release gives
the same pair from each, and drafter_choice.build_drafter picks the drafter for all of them."""

from __future__ import annotations

import argparse
import json

import pytest
from head_builders import medusa_heads, mirror_head

from specpair.config import ModelRef, PairSpec, Release, SpeculationConfig
from specpair.drafter_choice import build_drafter
from specpair.drafters import (EagleDrafter, LookupFirstDrafter, MedusaDrafter, ModelDrafter,
                               NgramDrafter)
from specpair.errors import SpecpairError, TokenizerMismatch

SPECULATION = {"k": 3, "dynamicK": False}


class Loaded(Exception):
    """Raised by the stand-in load_pair: the entry point got as far as loading, with this pair."""

    def __init__(self, pair: PairSpec):
        super().__init__(pair)
        self.pair = pair


@pytest.fixture
def loaded(monkeypatch):
    """Calls an entry point and returns the PairSpec it asked load_pair for (no weights load)."""
    import specpair.pair

    def stand_in(pair, progress=None):
        raise Loaded(pair)
    monkeypatch.setattr(specpair.pair, "load_pair", stand_in)

    def call(entry, *args):
        with pytest.raises(Loaded) as caught:
            entry(*args)
        return caught.value.pair
    return call


def _serve_args(*flags):
    from specpair.server.cli import add_engine_parser

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    return parser.parse_args(["engine", "serve", "--insecure", *flags])


def _cli(*argv):
    from specpair.cli import main
    return main(list(argv))


def _server(*flags):
    from specpair.server.cli import load_engine, read_release

    args = _serve_args("--device", "cpu", *flags)
    return load_engine(args, read_release(args.release) if args.release else None, lambda *_: None)


def _gate(release):
    from specpair.gate import run_gate
    return run_gate({**release, "gating": {"prompts": [{"prompt": "x"}]}}, device="cpu",
                    progress=lambda *_: None)


@pytest.mark.parametrize("drafting", ["draft model", "ngram"])
def test_every_entry_point_builds_the_same_pair_through_load_pair(loaded, tiny_pair_dirs, tmp_path, drafting):
    target = tiny_pair_dirs["target"]
    draft = {"source": tiny_pair_dirs["draft"]} if drafting == "draft model" else {"drafter": "ngram"}
    release = {"pair": "p", "target": {"source": target}, "draft": draft, "speculation": SPECULATION}
    release_file = tmp_path / "release.json"
    release_file.write_text(json.dumps(release))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    draft_flags = ["--draft", draft["source"]] if "source" in draft else ["--drafter", "ngram"]
    pair_flags = ["--target", target, *draft_flags, "--k", "3", "--no-dynamic-k"]
    built = {
        "specpair generate": loaded(_cli, "generate", *pair_flags, "--prompt", "x"),
        "specpair bench": loaded(_cli, "bench", *pair_flags, "--prompts", str(prompts)),
        "engine serve (flags)": loaded(_server, *pair_flags, "--batch-size-threshold", "8"),
        "engine serve --release": loaded(_server, "--release", str(release_file)),
        "specpair gate": loaded(_gate, release),
    }
    gated = Release.from_dict(release).pair
    for entry, pair in built.items():
        assert (pair.target, pair.draft, pair.drafter, pair.speculation) == \
            (gated.target, gated.draft, gated.drafter, gated.speculation), entry


def test_a_release_is_read_once_into_its_pair_and_names():
    release = Release.from_dict({"pair": "p", "target": {"source": "t", "revision": "abc"},
                                 "draft": {"source": "d", "revision": "def"},
                                 "speculation": {"k": 2}, "mlflow": {"version": 7}})
    assert release.pair == PairSpec(target=ModelRef("t", "abc"), draft=ModelRef("d", "def"),
                                    speculation=SpeculationConfig(k=2))
    assert (release.name, release.version, len(release.content_hash)) == ("p", "7", 64)
    with pytest.raises(SpecpairError, match=r"unknown drafter 'eagle9' \(known: ngram\)"):
        Release.from_dict({"target": {"source": "t"}, "draft": {"drafter": "eagle9"}})


def test_load_pair_builds_the_engine_the_pair_names(tiny_pair_dirs):
    from specpair.pair import load_pair

    said = []
    pair = PairSpec(target=ModelRef(tiny_pair_dirs["target"]), draft=ModelRef(tiny_pair_dirs["draft"]),
                    speculation=SpeculationConfig(k=3, dynamic_k=False), device="cpu")
    engine = load_pair(pair, progress=said.append)
    assert isinstance(engine.drafter, ModelDrafter) and engine.config == pair.speculation
    assert any(line.startswith("loading draft") for line in said)
    target_only = load_pair(PairSpec(target=pair.target, device="cpu"), progress=said.append)
    assert target_only.drafter is None


def _choice(target, draft=None, drafter=None, **speculation):
    return build_drafter(target, draft, drafter, speculation=SpeculationConfig(**speculation))


def test_build_drafter_chooses_by_what_the_pair_drafts_with(tiny_target, tiny_draft, one_layer_target):
    assert isinstance(_choice(tiny_target, drafter="ngram").drafter, NgramDrafter)
    assert isinstance(_choice(tiny_target, tiny_draft).drafter, ModelDrafter)
    assert isinstance(_choice(one_layer_target, mirror_head(one_layer_target)).drafter, EagleDrafter)
    assert isinstance(_choice(one_layer_target, medusa_heads(one_layer_target)).drafter, MedusaDrafter)
    first = _choice(one_layer_target, mirror_head(one_layer_target), lookup_min_match=2).drafter
    assert isinstance(first, LookupFirstDrafter) and isinstance(first.head, EagleDrafter)
    ignored = _choice(tiny_target, drafter="ngram", lookup_min_match=2)
    assert isinstance(ignored.drafter, NgramDrafter)
    assert ignored.warnings == ["lookup_min_match applies to drafting heads (EAGLE, Medusa); "
                                "the ngram engine ignores it"]
    assert _choice(tiny_target).drafter is None
    with pytest.raises(SpecpairError, match="need 1 <= --ngram-min <= --ngram-max"):
        build_drafter(tiny_target, drafter="ngram", speculation=SpeculationConfig(), ngram=(1, 2))


def test_build_drafter_refuses_or_drops_a_draft_whose_tokenizer_differs(tiny_target):
    from tiny_models import make_model, make_tokenizer

    other = make_model(make_tokenizer(vocab_size=350), seed=4)
    with pytest.raises(TokenizerMismatch, match="draft and target tokenizers differ: vocabulary sizes differ"):
        _choice(tiny_target, other)
    dropped = build_drafter(tiny_target, other, speculation=SpeculationConfig(), on_mismatch="target-only")
    assert dropped.drafter is None and dropped.draft is None
    assert dropped.warnings[0].startswith("draft tokenizer differs from the target's; serving target-only")
