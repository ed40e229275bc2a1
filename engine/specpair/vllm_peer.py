"""vLLM as a peer: a real vLLM OpenAI server process, driven over HTTP. Torch-free on purpose.

vLLM lives in its own virtualenv (scripts/setup-vllm.sh; vLLM pins its own torch and
transformers), which can import nothing of ours: this module starts
`python -P -m vllm.entrypoints.openai.api_server` there (the `vllm` command is broken in the
CPU package), outside the repository and without PYTHONPATH, and talks to it with the standard
library only, so the bench, the vLLM gate (gate/vllm.py), the vLLM engine pods (vllm_serve.py),
the operator's probe and the tests can use it without vLLM's dependencies.

On the CPU (the recipe measured in docs/bench/vllm-peer.md): `--dtype float32` (the default
downcasts to bf16: slow prefill on this CPU and other tokens), `--enforce-eager` (starts in ~40-50
s; compiling takes 80-300 s and its cache does not reload), VLLM_CPU_KVCACHE_SPACE=1 (GiB) and one
OpenMP thread. A server holds ~4 GB RSS in 4 processes (API server, engine core, worker, resource
tracker), all in one process group that `stop` ends together.

- `speculative_config`: our release's (or engine's) speculation settings as vLLM's
  `--speculative-config` (n-gram prompt lookup, a draft model or a drafting head, with its
  method and draft tensor-parallel size), None for target-only.
- `serving_flags`: the rest of a release's serving settings as vLLM's flags (tensor and pipeline
  parallel sizes, GPU memory share, context length, quantization, KV-cache dtype).
- `VllmServer`: start, wait for /health, `complete_greedy`, `spec_decode_counters`, stop.
- `parse_spec_decode_metrics`: the spec-decode counters of a /metrics text, as plain ints.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpair.config import NGRAM_MAX, NGRAM_MIN, SpeculationConfig
from specpair.contract import parallelism
from specpair.errors import SpecpairError

VLLM_VERSION = "0.32.0"
DEFAULT_START_TIMEOUT = 180.0   # seconds; a cold start here takes ~50 s (40 s on an idle machine)


def default_venv() -> Path:
    """Where scripts/setup-vllm.sh puts the vLLM virtualenv (SPECPAIR_VLLM_VENV overrides)."""
    env = os.environ.get("SPECPAIR_VLLM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "specpair" / f"vllm-venv-{VLLM_VERSION}"


def default_python() -> Path:
    """The vLLM virtualenv's python (what scripts/setup-vllm.sh prints last)."""
    return default_venv() / "bin" / "python"


# -- a release's serving settings -> vLLM's flags -------------------------------------------

# The release's engine settings (the SpecModelPair's spec.vllm, camelCase) and vLLM's flag for
# each; dtype is passed by every caller on its own (gate.vllm.dtype_of). A setting the release
# leaves out passes no flag: vLLM's default holds.
VLLM_FLAGS = {"gpuMemoryUtilization": "--gpu-memory-utilization", "maxModelLen": "--max-model-len",
              "quantization": "--quantization", "kvCacheDtype": "--kv-cache-dtype"}
# The release's parallelism (contract.parallelism) and vLLM's flag for each.
PARALLELISM_FLAGS = {"tensor": "--tensor-parallel-size", "pipeline": "--pipeline-parallel-size"}
# Structured outputs (a response_format, structured_outputs, a forced tool call) decoded as our
# engine decodes them (specpair.grammar): by llguidance, JSON in one compact form. vLLM's default
# (xgrammar, any whitespace) lets a model pad JSON with whitespace until max_tokens cuts it off
# (a tiny random model did on every golden JSON prompt) and ignores the forced call's
# "x-guidance" whitespace setting, so the same golden prompt passed on one engine and failed on
# the other. Every vLLM we start (the gate's servers, the engine pods) gets it.
STRUCTURED_OUTPUTS_FLAG = "--structured-outputs-config"
STRUCTURED_OUTPUTS = {"backend": "guidance", "disable_any_whitespace": True}


def serving_flags(release: dict) -> dict[str, str]:
    """vLLM's flags for how a release's target is served, flag -> value: the parallel sizes
    (always: 1 where the release splits nothing), structured outputs as our engine decodes them
    (STRUCTURED_OUTPUTS), and the engine settings the release sets."""
    flags = {PARALLELISM_FLAGS[key]: str(n) for key, n in parallelism(release).items()}
    flags[STRUCTURED_OUTPUTS_FLAG] = json.dumps(STRUCTURED_OUTPUTS, sort_keys=True)
    engine = release.get("engine") or {}
    flags.update({flag: str(engine[key]) for key, flag in VLLM_FLAGS.items() if engine.get(key) is not None})
    return flags


def flags_argv(flags: dict[str, str]) -> list[str]:
    return [part for flag, value in flags.items() for part in (flag, value)]


# -- speculation settings -> --speculative-config --------------------------------------------

# The gate's k by load in a vLLM release's speculation block (vllm_k_schedule; the operator puts
# it in the served release unless rollout.applyGateTuning is false).
K_BY_BATCH_SIZE = "kByBatchSize"
# The release's draft.method (the CRD's names) and vLLM's name for it (SpeculativeConfig.method).
VLLM_METHODS = {"draft-model": "draft_model", "ngram": "ngram", "eagle": "eagle", "eagle3": "eagle3",
                "mtp": "mtp", "medusa": "medusa"}


def ngram_defaults() -> tuple[int, int]:
    """(max_ngram, min_ngram): the engine's n-gram drafter defaults (specpair.config)."""
    return NGRAM_MAX, NGRAM_MIN


def speculative_config(release_or_settings: dict | None, *, k: int | None = None) -> dict | None:
    """vLLM's `--speculative-config` for the same speculation as ours; None: target-only.

    The one mapping from our settings to vLLM's. Accepts
    - a release (or SpecModelPair-like dict) with `draft` ({drafter: ngram} or {source: DIR},
      optionally with `method` and `draftTensorParallel`) and optional `speculation` ({k,
      enabled}); speculation.enabled false -> None. A draft model without a method leaves it
      to vLLM, which tells a draft model from a head by the checkpoint's config;
    - a drafter's `describe()` dict: {kind: ngram, max_ngram, min_ngram} or {kind: model, path}
      (what the bench has), with `k` given here;
    - None or {} -> None.
    k: explicit > the release's speculation.k > SpeculationConfig's default. vLLM drafts a fixed
    k (ours may adapt k at run time, starting from this one), or by batch size where the release
    carries the gate's speculation.kByBatchSize (vLLM's num_speculative_tokens_per_batch_size). A draft model's source must be
    something vLLM loads itself: a local model directory (or a hub id where there is a network);
    "default", GGUF files and MLflow URIs are resolved by our loader, not here.
    """
    if not release_or_settings:
        return None
    settings = dict(release_or_settings)
    schedule = None
    if "draft" in settings or "speculation" in settings:       # a release
        # The gate's k by load (vllm_k_schedule), vLLM's alone: our engine's reading never sees it.
        speculation = dict(settings.get("speculation") or {})
        schedule = speculation.pop(K_BY_BATCH_SIZE, None)
        spec = SpeculationConfig.from_release({**settings, "speculation": speculation})
        if not spec.enabled:
            return None
        if spec.tree_width > 1:
            raise SpecpairError("speculation.treeWidth is the specpair engine's token tree for "
                                "drafting heads; the vLLM backend verifies chains (leave treeWidth "
                                "out, or serve with engine: specpair)")
        if spec.lookup_min_match > 0:
            raise SpecpairError("speculation.lookupMinMatch (prompt lookup before a drafting head) "
                                "is the specpair engine's; vLLM drafts with one method (leave it "
                                "out, or serve with engine: specpair)")
        draft = settings.get("draft") or {}
        k = spec.k if k is None else k
        if draft.get("drafter"):
            kind = str(draft["drafter"])
            settings = {"kind": kind, "max_ngram": draft.get("maxNgram"), "min_ngram": draft.get("minNgram")}
        elif draft.get("source"):
            settings = {"kind": "model", "path": draft["source"], "method": draft.get("method"),
                        "draft_tensor_parallel": draft.get("draftTensorParallel")}
        else:
            raise SpecpairError("release.draft needs 'source' (a model) or 'drafter' (e.g. 'ngram')")
    k = SpeculationConfig().k if k is None else int(k)
    if k < 1:
        raise SpecpairError(f"speculation k must be >= 1, got {k}")
    config = _speculative_config(settings, k)
    if schedule is not None:
        config["num_speculative_tokens_per_batch_size"] = checked_schedule(schedule, k)
    return config


def checked_schedule(schedule: Any, k: int) -> list[list[int]]:
    """A release's speculation.kByBatchSize as vLLM's num_speculative_tokens_per_batch_size, after
    vLLM's own rules (validate_and_normalize_dynamic_sd_schedule): inclusive [start, end, k] ranges,
    sorted, not overlapping, the first from 1; each k from 0 to the release's k (vLLM would cap
    a larger one silently: the release would serve other than it says)."""
    what = f"speculation.{K_BY_BATCH_SIZE}"
    if not isinstance(schedule, list) or not schedule:
        raise SpecpairError(f"{what} must be a non-empty list of [start, end, k] ranges, got {schedule!r}")
    out, previous_end = [], 0
    for entry in schedule:
        if not (isinstance(entry, list) and len(entry) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) for x in entry)):
            raise SpecpairError(f"{what}: each range is [start, end, k] (integers), got {entry!r}")
        start, end, chosen = entry
        if (start != 1) if not out else (start <= previous_end):
            raise SpecpairError(f"{what}: ranges must be sorted, not overlap, and the first start at 1; "
                                f"got {schedule!r}")
        if not 1 <= start <= end or not 0 <= chosen <= k:
            raise SpecpairError(f"{what}: range {entry!r} needs 1 <= start <= end and 0 <= k <= {k}")
        out.append([start, end, chosen])
        previous_end = end
    return out


def _speculative_config(settings: dict, k: int) -> dict:
    kind = settings.get("kind")
    if kind == "ngram":
        default_max, default_min = ngram_defaults()
        max_n = int(settings.get("max_ngram") or default_max)
        min_n = int(settings.get("min_ngram") or default_min)
        if not 1 <= min_n <= max_n:
            raise SpecpairError(f"need 1 <= min_ngram <= max_ngram, got {min_n}, {max_n}")
        return {"method": VLLM_METHODS["ngram"], "num_speculative_tokens": k,
                "prompt_lookup_max": max_n, "prompt_lookup_min": min_n}
    if kind == "model":
        model = settings.get("path") or settings.get("source")
        if not model:
            raise SpecpairError("a draft model needs 'path' (a local model directory)")
        config: dict[str, Any] = {"model": str(model), "num_speculative_tokens": k}
        method = settings.get("method")
        if method is not None:
            if method not in VLLM_METHODS or method == "ngram":
                raise SpecpairError(f"draft method {method!r} with a draft model: one of "
                                    f"{', '.join(m for m in VLLM_METHODS if m != 'ngram')}")
            config["method"] = VLLM_METHODS[method]
        if settings.get("draft_tensor_parallel") is not None:
            config["draft_tensor_parallel_size"] = int(settings["draft_tensor_parallel"])
        return config
    raise SpecpairError(f"no vLLM speculative config for drafter {kind!r} (known: ngram, model)")


# -- /metrics ------------------------------------------------------------------------------


@dataclass
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters, summed over their label sets (engine, model_name).

    Zero everywhere on a server without speculation (vLLM exports none there)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "SpecDecodeCounters":
        return cls(int(d["drafts"]), int(d["draft_tokens"]), int(d["accepted_tokens"]),
                   [int(x) for x in d.get("accepted_per_position") or []])

    def _combine(self, other: "SpecDecodeCounters", sign: int) -> "SpecDecodeCounters":
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return SpecDecodeCounters(
            self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
            self.accepted_tokens + sign * other.accepted_tokens,
            [a + sign * b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))])

    def __add__(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        return self._combine(other, 1)

    def __sub__(self, before: "SpecDecodeCounters") -> "SpecDecodeCounters":
        """What happened between two scrapes of the same server."""
        return self._combine(before, -1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (our AcceptanceStats.acceptance_rate)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted per draft (ours and vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Accepted at each position per draft (vLLM's per-position rate: it counts no drafts
        per position, so a draft shorter than k counts as rejected at the positions it lacks)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position]}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
             "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens"}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def parse_spec_decode_metrics(text: str) -> SpecDecodeCounters:
    """The spec-decode counters of a Prometheus text exposition (vLLM's /metrics)."""
    totals = {name: 0.0 for name in _COUNTERS.values()}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            number = float(value)
        except ValueError:
            continue
        if name in _COUNTERS:
            totals[_COUNTERS[name]] += number
        elif name == _PER_POSITION:
            position = dict(_LABEL.findall(labels)).get("position")
            if position is not None and position.isdigit():
                per_pos[int(position)] = per_pos.get(int(position), 0.0) + number
    positions = [int(round(per_pos.get(i, 0.0))) for i in range(max(per_pos) + 1)] if per_pos else []
    return SpecDecodeCounters(drafts=int(round(totals["drafts"])),
                              draft_tokens=int(round(totals["draft_tokens"])),
                              accepted_tokens=int(round(totals["accepted_tokens"])),
                              accepted_per_position=positions)


# -- the server ------------------------------------------------------------------------------


@dataclass
class Completion:
    token_ids: list[int]
    seconds: float                  # wall time of the HTTP request (prefill + decode + HTTP)
    text: str = ""
    finish_reason: str | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_model_len(model_dir: str | Path, cap: int = 2048) -> int | None:
    """The model's context, capped: the KV cache (1 GiB here) and start-up stay small."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = config.get("max_position_embeddings")
    return min(int(n), cap) if isinstance(n, int) and n > 0 else None


class VllmServer:
    """One vLLM OpenAI server process on 127.0.0.1 (context manager: started and stopped).

        with VllmServer(default_python(), model_dir, speculative=speculative_config(...)) as vllm:
            out = vllm.complete_greedy(prompt_ids, 64)
            counters = vllm.spec_decode_counters()
    """

    def __init__(self, python: str | Path, model_dir: str | Path, *, speculative: dict | None = None,
                 port: int = 0, dtype: str = "float32", served_model_name: str = "peer",
                 max_model_len: int | None = None, start_timeout: float = DEFAULT_START_TIMEOUT,
                 extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 log_path: str | Path | None = None, argv: list[str] | None = None, uds: str | Path | None = None,
                 stop_seconds: float = 30.0):
        """`argv`: run this command instead of vLLM's own line (an engine pod's container command
        as the operator renders it: `python -m specpair.vllm_serve --release ... --uds ...`);
        `uds`: the server listens on this Unix socket, not on `port` (health, requests and
        /metrics go there); `stop_seconds`: how long `stop` waits after SIGTERM before SIGKILL
        (a pod's supervisor holds vLLM's SIGTERM until its companion drained)."""
        self.python = str(python)
        self.model_dir = str(model_dir)
        self.speculative = speculative
        self.port = port or free_port()
        self.dtype = dtype
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len or _max_model_len(model_dir)
        self.start_timeout = start_timeout
        self.extra_env = dict(extra_env or {})
        self.extra_args = list(extra_args or [])
        self.argv = list(argv) if argv is not None else None
        self.uds = str(uds) if uds is not None else None
        self.stop_seconds = stop_seconds
        self._workdir: str | None = None
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self.last_log = ""              # the log's tail, kept when stop() removes the log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.argv is not None:
            return list(self.argv)
        # -P: the working directory is not put on sys.path, so nothing of ours is importable.
        cmd = [self.python, "-P", "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model_dir, "--dtype", self.dtype, "--enforce-eager",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", self.served_model_name,
               # The model's generation_config.json keeps its special tokens (EOS) but its
               # sampling defaults (repetition penalty...) are not applied: greedy as ours.
               "--generation-config", "vllm"]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.speculative:
            cmd += ["--speculative-config", json.dumps(self.speculative)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",       # GiB of KV cache
            "OMP_NUM_THREADS": "1",
            "PYTHONNOUSERSITE": "1",
            "VLLM_NO_USAGE_STATS": "1",          # no telemetry (no network here anyway)
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",               # local model directories only: never wait on a hub
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        })
        env.update(self.extra_env)
        return env

    def start(self) -> "VllmServer":
        python = Path(self.python)
        if not python.exists():
            raise SpecpairError(f"no vLLM python at {python}: run `bash scripts/setup-vllm.sh` "
                                f"(or pass --vllm-python)")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise SpecpairError(f"vLLM needs a local model directory with config.json: {self.model_dir}")
        self._workdir = tempfile.mkdtemp(prefix="specpair-vllm-")
        if self.log_path is None:
            self.log_path = Path(self._workdir) / "server.log"
        log = open(self.log_path, "wb")
        started = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.command(), cwd=self._workdir, env=self.environment(),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        deadline = started + self.start_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise SpecpairError(f"vLLM server exited with code {code} before it was healthy; "
                                    f"its log ends:\n{self.log_tail()}")
            try:
                if self._get("/health", timeout=5)[0] == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() > deadline:
                raise SpecpairError(f"vLLM server not healthy after {self.start_timeout:.0f} s; "
                                    f"its log ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace") if self.log_path else ""
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM to the whole process group, SIGKILL after `timeout` (`stop_seconds`); waits
        until none is left."""
        timeout = self.stop_seconds if timeout is None else timeout
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid   # start_new_session: the server leads its own group
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                if _wait_group_gone(proc, pgid, wait):
                    break
            else:
                raise SpecpairError(f"vLLM server process group {pgid} survived SIGKILL")
        if self._workdir:
            if self.log_path and str(self.log_path).startswith(self._workdir):
                self.last_log = self.log_tail(200)
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- requests ---------------------------------------------------------------------------

    def _get(self, path: str, data: bytes | None = None, timeout: float = 600.0) -> tuple[int, bytes]:
        """(status, body) of a GET (a POST of JSON `data`), on the port or the Unix socket."""
        headers = {"Content-Type": "application/json"} if data else {}
        if self.uds is None:
            req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
        conn = _UnixHTTPConnection(self.uds, timeout=timeout)
        try:
            conn.request("POST" if data is not None else "GET", path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _request(self, path: str, payload: dict | None = None, timeout: float = 600.0) -> bytes:
        data = None if payload is None else json.dumps(payload).encode()
        try:
            status, body = self._get(path, data, timeout)
        except (urllib.error.URLError, OSError) as exc:
            raise SpecpairError(f"vLLM {path} unreachable ({exc}); its log ends:\n{self.log_tail()}") from exc
        if status != 200:
            raise SpecpairError(f"vLLM {path} answered {status}: {body.decode(errors='replace')[:2000]}")
        return body

    def complete_greedy(self, prompt: list[int] | str, max_tokens: int, *, ignore_eos: bool = False,
                        timeout: float = 600.0, structured_outputs: dict | None = None) -> Completion:
        """Greedy (temperature 0) completion of a token-id list (sent as is: no BOS or chat
        template added) or a text; returns the generated token ids (with the EOS that ended
        them, as ours) and the request's wall time. `structured_outputs`: vLLM's field of that
        name (a golden prompt's structure, gate/structured.vllm_structured_outputs)."""
        payload: dict[str, Any] = {"model": self.served_model_name, "prompt": prompt,
                                   "max_tokens": int(max_tokens), "temperature": 0.0,
                                   "return_token_ids": True, "ignore_eos": ignore_eos}
        if structured_outputs is not None:
            payload["structured_outputs"] = structured_outputs
        if isinstance(prompt, str):
            payload["add_special_tokens"] = True
        started = time.perf_counter()
        body = self._request("/v1/completions", payload, timeout=timeout)
        seconds = time.perf_counter() - started
        choice = json.loads(body)["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise SpecpairError("vLLM returned no token_ids (return_token_ids unsupported?)")
        return Completion(token_ids=[int(t) for t in ids], seconds=seconds, text=choice.get("text") or "",
                          finish_reason=choice.get("finish_reason"))

    def metrics_text(self) -> str:
        return self._request("/metrics", timeout=30).decode(errors="replace")

    def spec_decode_counters(self) -> SpecDecodeCounters:
        return parse_spec_decode_metrics(self.metrics_text())


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 to a server on a Unix socket (an engine pod's vLLM, behind its companion)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _wait_group_gone(proc: subprocess.Popen, pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.1)
    return False
