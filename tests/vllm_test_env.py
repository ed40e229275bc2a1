"""vLLM's settings for every vLLM server the tests start: the engine tests' own (from the test
process's environment) and those in the devcluster's vLLM image (its environment). A module,
not conftest, so any test folder can import it."""

# vLLM's own switch: the model worker runs in the engine core's process (vLLM's "uni" executor)
# instead of a process of its own. Every process vLLM starts imports vLLM and torch again before
# it does anything (the worker's ~12 CPU-s of the ~28 a tiny model's server took to start); the
# model, its scheduler, speculation and the OpenAI server are the same. Measured alone:
# test_engine_vllm_peer.py (one server) 33.0 s -> 26.0 s, 28.4 -> 17.0 CPU-s of vLLM.
VLLM_TEST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
