"""One limit on k (contract.MAX_SPECULATION_K) for every place k is set: the CRD a spec is
admitted by, the request parser (gRPC and OpenAI requests), and the engine's configuration."""

from pathlib import Path

import pytest
import yaml

from specpair.config import GenerationParams, SpeculationConfig
from specpair.contract import MAX_SPECULATION_K
from specpair.errors import SpecpairError
from specpair.server.requests import InvalidField, Limits, RequestFields, check_fields

REPO = Path(__file__).resolve().parents[2]


def crd_speculation_bounds():
    crd = yaml.safe_load((REPO / "crds" / "specmodelpair.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    k = spec["speculation"]["properties"]["k"]
    k_values = spec["gating"]["properties"]["tuning"]["properties"]["kValues"]["items"]
    return k, k_values


def test_the_crd_bounds_k_where_the_engine_does():
    k, k_values = crd_speculation_bounds()
    assert (k["minimum"], k["maximum"]) == (1, MAX_SPECULATION_K)
    assert (k_values["minimum"], k_values["maximum"]) == (1, MAX_SPECULATION_K)


def test_the_engine_config_takes_k_up_to_the_limit_and_refuses_past_it():
    assert SpeculationConfig(k=MAX_SPECULATION_K).k_max == MAX_SPECULATION_K
    with pytest.raises(SpecpairError, match=f"<= {MAX_SPECULATION_K}"):
        SpeculationConfig(k=MAX_SPECULATION_K + 1)
    with pytest.raises(SpecpairError, match=f"<= {MAX_SPECULATION_K}"):
        SpeculationConfig(k=4, k_max=MAX_SPECULATION_K + 1)
    assert GenerationParams(speculation_k=MAX_SPECULATION_K).speculation_k == MAX_SPECULATION_K
    with pytest.raises(SpecpairError, match=f"\\[0, {MAX_SPECULATION_K}\\]"):
        GenerationParams(speculation_k=MAX_SPECULATION_K + 1)


def test_a_request_may_ask_for_k_up_to_the_limit_and_no_further():
    ok = check_fields(RequestFields(prompt="hi", max_new_tokens=4, speculation_k=MAX_SPECULATION_K), Limits())
    assert ok.params.speculation_k == MAX_SPECULATION_K
    with pytest.raises(InvalidField, match=f"<= {MAX_SPECULATION_K}"):
        check_fields(RequestFields(prompt="hi", max_new_tokens=4, speculation_k=MAX_SPECULATION_K + 1), Limits())
