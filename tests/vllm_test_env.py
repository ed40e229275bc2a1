"""vLLM's settings for every vLLM server the tests start: the engine tests' own (from the test
process's environment) and those in the devcluster's vLLM image (its environment). A module,
not conftest, so any test folder can import it."""

from pathlib import Path

VLLM_TEST_ENV = {
    # vLLM's own switch: the model worker runs in the engine core's process (vLLM's "uni"
    # executor) instead of a process of its own. Every process vLLM starts imports vLLM and torch
    # again before it does anything (the worker's ~12 CPU-s of the ~28 a tiny model's server took
    # to start); the model, its scheduler, speculation and the OpenAI server are the same.
    # Measured alone: test_engine_vllm_peer.py (one server) 33.0 s -> 26.0 s.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's cache where this machine keeps it (vLLM's default under HOME), as an image ships
    # its cache warm: a devcluster pod's HOME is a folder of its own, where vLLM finds no
    # model-info cache and inspects the model class in one more process (another import of vLLM
    # and torch): a tiny model's server started in 24.5 s so, 16.5 s with the cache.
    "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "vllm"),
}
