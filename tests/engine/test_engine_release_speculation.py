"""A release's speculation block, read once (SpeculationConfig.from_release): the gate measures what
the engine server serves, bad blocks are refused before anything loads, defaults live in one place."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from specpair.config import (RELEASE_SPECULATION_KEYS, SpeculationConfig,
                             release_speculation_defaults)
from specpair.errors import SpecpairError
from specpair.server.cli import add_engine_parser, read_release, served_pair


def _serve_args(*flags):
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    return parser.parse_args(["engine", "serve", *flags])


def _served(tmp_path, speculation, *flags):
    """What `engine serve --release FILE FLAGS` would load, on a CPU."""
    release = tmp_path / "release.json"
    release.write_text(json.dumps({"pair": "p", "target": {"source": "default"},
                                   "draft": {"drafter": "ngram"}, "speculation": speculation}))
    args = _serve_args("--release", str(release), *flags)
    return served_pair(args, read_release(args.release), "cpu")


def test_every_key_sets_its_setting_and_absent_keys_keep_the_defaults():
    block = {"k": 6, "dynamicK": False, "fallbackThreshold": 0.25, "batchSizeThreshold": 3,
             "treeWidth": 2, "lookupMinMatch": 1, "enabled": False}
    assert set(block) == set(RELEASE_SPECULATION_KEYS)
    got = SpeculationConfig.from_release({"speculation": block})
    assert (got.k, got.dynamic_k, got.fallback_threshold, got.batch_size_threshold, got.tree_width,
            got.lookup_min_match, got.enabled) == (6, False, 0.25, 3, 2, 1, False)
    assert SpeculationConfig.from_release({}) == SpeculationConfig()
    assert SpeculationConfig.from_release({"speculation": {"k": 2}}) == SpeculationConfig(k=2)
    # An integer where a float is asked is that float (JSON writes 1.0 as 1 in some tools).
    assert SpeculationConfig.from_release({"speculation": {"fallbackThreshold": 1}}).fallback_threshold == 1.0
    # The operator's gate tuning writes 0 where speculation paid at no batch size: never speculate.
    assert SpeculationConfig.from_release({"speculation": {"batchSizeThreshold": 0}}).batch_size_threshold == 0


@pytest.mark.parametrize("block,words", [
    ({"kk": 3}, "speculation.kk: not a setting this engine knows"),
    ({"k": 2.5}, "speculation.k: expected int, got 2.5"),
    ({"k": True}, "speculation.k: expected int, got True"),
    ({"dynamicK": "false"}, "speculation.dynamicK: expected bool, got 'false'"),
    ({"fallbackThreshold": "0.5"}, "speculation.fallbackThreshold: expected float"),
    ({"treeWidth": 9}, "tree_width must be in 1..4, got 9"),
    ({"batchSizeThreshold": -1}, "batch_size_threshold must be >= 0"),
])
def test_a_block_the_engine_cannot_serve_is_refused_with_the_key(block, words):
    with pytest.raises(SpecpairError, match=re.escape(words)):
        SpeculationConfig.from_release({"speculation": block})


def test_the_defaults_a_release_is_hashed_with_are_the_configs():
    """The operator writes these into every release (its content hash); the CRD's defaults are
    held equal to them in test_operator_packaging."""
    assert release_speculation_defaults() == {"k": 4, "dynamicK": True, "fallbackThreshold": 0.5,
                                              "batchSizeThreshold": 8}


def test_a_starting_k_above_the_cap_raises_the_cap():
    assert SpeculationConfig(k=12).k_max == 12
    assert SpeculationConfig(k=3).k_max == SpeculationConfig().k_max


def test_the_server_serves_what_the_gate_measured_whatever_its_flags(tmp_path):
    block = {"k": 3, "dynamicK": False, "batchSizeThreshold": 2}
    served = _served(tmp_path, block, "--k", "7", "--tree-width", "2", "--batch-size-threshold", "5").speculation
    assert served == SpeculationConfig.from_release({"speculation": block})
    assert (served.k, served.tree_width, served.batch_size_threshold) == (3, 1, 2)
    # --no-spec still turns it off (serving a release target-only by hand).
    off = _served(tmp_path, block, "--no-spec")
    assert not off.speculation.enabled and not off.speculates
    # Without a release, the flags (and the device's batch threshold where none is given).
    flags = served_pair(_serve_args("--k", "5", "--no-dynamic-k"), None, "cpu").speculation
    assert (flags.k, flags.dynamic_k, flags.batch_size_threshold) == (5, False, 1)


def test_the_server_refuses_an_unservable_release_before_loading(tmp_path):
    with pytest.raises(SpecpairError, match="speculation.speculativeTokens: not a setting"):
        _served(tmp_path, {"k": 3, "speculativeTokens": 5})
