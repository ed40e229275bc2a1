"""Fixtures for the gRPC server tests: real servers on 127.0.0.1 serving tiny seeded models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/tiny_models.py

from serving_helpers import client_for, make_engine, tiny_server  # noqa: E402
from tiny_models import make_model, make_tokenizer, perturbed_copy  # noqa: E402

from specpair.server.app import EngineServer, ServerOptions  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair():
    tok = make_tokenizer()
    target = make_model(tok, seed=11)
    # Target weights plus noise: accepts some drafts, rejects others (cache cut-backs run).
    draft = perturbed_copy(target, seed=12, noise=0.03)
    return target, draft


@pytest.fixture
def start_server(tiny_pair):
    """start_server(engine=None, **ServerOptions fields) -> running EngineServer (stopped after)."""
    servers = []

    def start(engine=None, load=None, wait=True, **options):
        options.setdefault("port", 0)
        options.setdefault("metrics_port", 0)
        options.setdefault("drain_timeout", 5.0)
        options.setdefault("pair", "tiny")
        options.setdefault("version", "1")
        engine = engine or make_engine(tiny_pair)
        server = EngineServer(load or (lambda: engine), ServerOptions(**options), progress=lambda _m: None)
        servers.append(server)
        server.start(wait_ready=wait, timeout=60)
        return server

    yield start
    for server in servers:
        server.stop(drain_timeout=1.0)


@pytest.fixture(scope="module")
def shared_server(tiny_pair):
    """One server for the tests that need nothing special (saves start-up time)."""
    with tiny_server(tiny_pair, max_queue=32) as server:
        yield server


@pytest.fixture
def client(shared_server):
    with client_for(shared_server) as c:
        yield c
