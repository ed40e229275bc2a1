"""The operator's MLflow requests search sys.path for no module: MLflow's client asks before every
request whether it runs inside Databricks by importing dbruntime, IPython and pyspark, and an
import that failed is searched for along the whole path again each time (0.43 ms of CPU a
request). clients/registry.py records those that are not installed as absent, once."""

from __future__ import annotations

import importlib.util
import sys
import uuid

import pytest

from specpair_operator.clients import registry as registry_module


class LookupRecorder:
    """A finder first on sys.meta_path: the names the import system searches for, found by the
    finders after it (it finds nothing itself)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name, path=None, target=None):
        self.names.append(name)
        return None


@pytest.fixture
def lookups():
    recorder = LookupRecorder()
    sys.meta_path.insert(0, recorder)
    try:
        yield recorder.names
    finally:
        sys.meta_path.remove(recorder)


def test_a_request_to_the_real_mlflow_server_searches_for_no_module(reg, lookups):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")                     # its first requests may import what they use
    lookups.clear()
    for _ in range(3):
        assert reg.ensure_model(model, "ns/p") is not None
        reg.client.get_registered_model(model)
    probed = [n for n in lookups if n.split(".")[0] in registry_module.DATABRICKS_PROBED_MODULES]
    assert probed == [], f"MLflow's requests searched sys.path for {sorted(set(probed))}"


def test_only_modules_that_are_not_installed_are_recorded_absent(monkeypatch):
    # json is installed: never recorded absent. A name no package has is, and importing it still
    # fails as before, at once; find_spec still answers None for it.
    missing = f"specpair_no_such_module_{uuid.uuid4().hex[:8]}"
    monkeypatch.delitem(sys.modules, missing, raising=False)
    assert registry_module.answer_absent_modules_at_once(("json", missing)) == [missing]
    try:
        assert sys.modules[missing] is None and "json" in sys.modules and sys.modules["json"] is not None
        with pytest.raises(ImportError):
            __import__(missing)
        assert importlib.util.find_spec(missing) is None
        assert registry_module.answer_absent_modules_at_once((missing,)) == []      # once
    finally:
        sys.modules.pop(missing, None)
