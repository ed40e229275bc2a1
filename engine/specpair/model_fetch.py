"""`specpair fetch-models`: a release's models into a shared model cache, once, before any engine
pod starts, so that N replicas (and the gate) read one copy offline instead of each downloading.

The cache is one directory (a PersistentVolumeClaim that engine and gate pods mount read-only as
HF_HUB_CACHE, with HF_HUB_OFFLINE=1):

- hub models: Hugging Face's own hub-cache layout (`models--ORG--NAME/` with `blobs/`,
  `snapshots/COMMIT/` and `refs/REVISION`), written by huggingface_hub, so transformers and vLLM
  find them offline by id and revision.
- MLflow models: `specpair-mlflow/KEY/` (models.prefetched_mlflow_model reads them there). Each
  is downloaded into a staging folder beside it and moved into place by one rename: a model
  folder is whole or absent.
- `.specpair/models/KEY.json`: one marker per model fetched (source, revision, where it landed),
  and `.specpair/releases/DIGEST.json`: the release's completion marker, keyed by its content
  hash, written last. Markers are written to a temporary file and renamed.

Idempotent: a model whose marker is there and whose files are where it says is skipped; so is a
source that needs no fetch (the embedded default target, a model-free drafter, a path in the
image). Hub files are themselves staged by huggingface_hub (`.incomplete`, then renamed), and a
hub model counts as present only once its marker is written after the whole snapshot.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from specpair.contract import MLFLOW_SOURCE_PREFIXES, content_hash, source_kind
from specpair.errors import SpecpairError

MARKER_DIR = ".specpair"
# Files transformers' PyTorch loading never reads: not fetched (a hub repo may hold its weights
# in several frameworks' formats).
HUB_IGNORE = ["*.h5", "*.msgpack", "*.onnx", "onnx/*", "*.tflite", "*.ot", "flax_model*", "tf_model*",
              "coreml/*", "*.mlmodel"]
ROLES = ("target", "draft")
# An `mlflow:` source is an artifact URI MLflow downloads: it must name a place MLflow reaches
# over the network (models:/, runs:/, mlflow-artifacts:/, s3://, ...). A local one (file:, an
# absolute or relative path, `.`) would copy whatever the fetch container can read into the shared
# cache, for every pair that mounts it; `.` or `..` as a path segment leaves the model's folder.
# RE2 and Python read these alike: the CRD's CEL rules use them as they are (validation.py).
REMOTE_MLFLOW_URI = r"^mlflow:[A-Za-z][-A-Za-z0-9+.]*:"
LOCAL_MLFLOW_URI = r"^mlflow:(?i:file):"
DOT_SEGMENT = r"[:/][.][.]?(/|$)"
# A cache folder's name: one level under specpair-mlflow/, never one of the folder's own files
# (locks and staging folders start with a dot), at most a file name's length.
MAX_KEY_BYTES = 255


def mlflow_uri_is_local(source: str) -> bool:
    """An `mlflow:` source that is a path or a file: URI (the fetch container's own files)."""
    return source.startswith("mlflow:") and (re.search(REMOTE_MLFLOW_URI, source) is None
                                             or re.search(LOCAL_MLFLOW_URI, source) is not None)


def mlflow_uri_leaves_its_folder(source: str) -> bool:
    """An MLflow source (models:/, runs:/, mlflow:) with a `.` or `..` path segment."""
    return source.startswith(MLFLOW_SOURCE_PREFIXES) and re.search(DOT_SEGMENT, source) is not None


def mlflow_source_problem(source: str) -> str:
    """Why an MLflow model source must not be fetched ('' when it may). The operator's validation
    and the CRD's rules say the same (operator/specpair_operator/crd/validation.py); the fetch checks
    again, for a release made before they existed."""
    if mlflow_uri_is_local(source):
        return (f"{source!r} reads the fetching container's own files: an mlflow: source must be a remote "
                f"artifact URI (models:/NAME/VERSION, runs:/RUN/PATH, mlflow-artifacts:/..., s3://...)")
    if mlflow_uri_leaves_its_folder(source):
        return f"{source!r} has a '.' or '..' path segment: a model source names its model's own folder"
    return ""


def safe_cache_key(key: str) -> str:
    """`key` when it is one folder name of its own under the cache's MLflow folder; else a
    SpecpairError (a key of '.', '..', a path, or a dot file would read or write another pair's
    model, a lock or a staging folder)."""
    if not key or key.startswith(".") or "/" in key or "\\" in key or "\0" in key \
            or len(key.encode()) > MAX_KEY_BYTES:
        raise SpecpairError(f"model cache key {key!r} is not a folder name of its own")
    return key


@dataclass(frozen=True)
class ModelToFetch:
    role: str                  # target or draft (a draft model or a drafting head)
    source: str
    revision: str | None
    kind: str                  # models.source_kind: mlflow or hub (the others need no fetch)

    @property
    def key(self) -> str:
        """The model's marker name: one per source and revision."""
        text = json.dumps([self.kind, self.source, self.revision or ""])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def describe(self) -> str:
        where = "MLflow" if self.kind == "mlflow" else "the Hugging Face hub"
        rev = f" at revision {self.revision}" if self.revision and self.kind == "hub" else ""
        return f"{self.role} {self.source}{rev} from {where}"


@dataclass(frozen=True)
class Fetched:
    role: str
    source: str
    revision: str | None
    kind: str
    outcome: str               # fetched, present (skipped) or image (nothing to fetch)
    path: str = ""             # relative to the cache directory ('' when nothing is there)
    seconds: float = 0.0


def release_models(release: dict[str, Any]) -> tuple[list[ModelToFetch], list[Fetched]]:
    """The release's models a fetch downloads, and those it leaves where they are: the embedded
    default, a model-free drafter, a local path (in the image; refused when missing there too,
    as the engine would refuse it)."""
    fetch: list[ModelToFetch] = []
    nothing: list[Fetched] = []
    for role in ROLES:
        side = release.get(role) or {}
        if side.get("drafter") or (role == "draft" and not side.get("source")):
            continue
        source = str(side.get("source") or "default")
        revision = str(side["revision"]) if side.get("revision") else None
        kind = source_kind(source)
        problem = mlflow_source_problem(source) if kind == "mlflow" else ""
        if problem:
            raise SpecpairError(f"{role}.source: {problem}")
        if kind in ("mlflow", "hub"):
            fetch.append(ModelToFetch(role, source, revision, kind))
            continue
        if kind in ("local", "gguf") and not Path(source).expanduser().exists():
            raise SpecpairError(f"{role} {source}: model path not found (a path is read from the engine "
                                f"image, so there is nothing to fetch, and the engine would not find it either)")
        nothing.append(Fetched(role, source, revision, kind, "image"))
    return fetch, nothing


def release_of(*, release_file: str | None = None, target: str | None = None, target_revision: str | None = None,
               draft: str | None = None, draft_revision: str | None = None) -> dict[str, Any]:
    """The release to fetch for: the release file, else one made of the model flags (as
    `specpair engine serve` takes them)."""
    if release_file and (target or draft):
        raise SpecpairError("fetch-models takes --release FILE or the model flags (--target, --draft), not both")
    if release_file:
        try:
            with open(release_file, encoding="utf-8") as fh:
                release = json.load(fh)
        except (OSError, ValueError) as exc:
            raise SpecpairError(f"cannot read release file {release_file}: {exc}") from exc
        if not isinstance(release, dict):
            raise SpecpairError(f"release file {release_file}: expected a JSON object")
        return release
    if not target:
        raise SpecpairError("fetch-models needs --release FILE or --target SOURCE")
    return {"target": {"source": target, "revision": target_revision},
            "draft": {"source": draft, "revision": draft_revision} if draft else {}}


class ModelCache:
    """The cache directory and its markers."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def model_marker(self, model: ModelToFetch) -> Path:
        return self.root / MARKER_DIR / "models" / f"{model.key}.json"

    def release_marker(self, digest: str) -> Path:
        return self.root / MARKER_DIR / "releases" / f"{digest}.json"

    def present(self, model: ModelToFetch) -> str | None:
        """Where the model is, relative to the cache, if its marker is there and so are its files."""
        try:
            marker = json.loads(self.model_marker(model).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        path = str(marker.get("path") or "")
        return path if path and (self.root / path / "config.json").is_file() else None

    def write_json(self, path: Path, value: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(value, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)


def _fetch_mlflow(cache: ModelCache, model: ModelToFetch, progress: Callable[[str], None]) -> Path:
    """Download an MLflow model's artifacts (MLFLOW_TRACKING_URI and the MLflow credentials from
    the environment) into a staging folder, then rename it into place."""
    from specpair.models import PREFETCHED_MLFLOW_DIR, mlflow_cache_key, model_config_dir

    parent = cache.root / PREFETCHED_MLFLOW_DIR
    final = parent / safe_cache_key(mlflow_cache_key(model.source))
    parent.mkdir(parents=True, exist_ok=True)
    # One fetch of a model at a time (two releases' Jobs may share it): the lock's holder finds
    # the model there, or knows each staging folder of it belongs to a fetch that died.
    with open(parent / f".{final.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if model_config_dir(final) is None:
            for stale in parent.iterdir():
                if stale.name.startswith(f".staging-{final.name}-"):
                    shutil.rmtree(stale, ignore_errors=True)
            _download_mlflow(model, parent / f".staging-{final.name}-{uuid.uuid4().hex[:8]}", final, progress)
    found = model_config_dir(final)
    assert found is not None
    return found


def _download_mlflow(model: ModelToFetch, staging: Path, final: Path, progress: Callable[[str], None]) -> None:
    from specpair.models import model_config_dir

    try:
        import mlflow.artifacts
    except ImportError as exc:
        raise SpecpairError("MLflow model URIs need the mlflow package") from exc
    try:
        progress(f"downloading {model.describe()}")
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=model.source.removeprefix("mlflow:"), dst_path=str(staging))
        except Exception as exc:   # MLflow raises its own types (RestException, MlflowException, ...)
            raise SpecpairError(f"cannot fetch {model.describe()} "
                                f"({os.environ.get('MLFLOW_TRACKING_URI') or 'no MLFLOW_TRACKING_URI'}): "
                                f"{_first_line(exc)}") from exc
        if model_config_dir(staging) is None:
            raise SpecpairError(f"cannot fetch {model.describe()}: its artifacts hold no config.json "
                                f"(not a transformers model)")
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fetch_hub(cache: ModelCache, model: ModelToFetch, progress: Callable[[str], None]) -> Path:
    """snapshot_download into the hub-cache layout (HF_TOKEN from the environment, if set)."""
    from huggingface_hub import snapshot_download

    progress(f"downloading {model.describe()}")
    try:
        path = snapshot_download(model.source, revision=model.revision, cache_dir=str(cache.root),
                                 token=os.environ.get("HF_TOKEN") or None, ignore_patterns=HUB_IGNORE)
    except Exception as exc:   # huggingface_hub: RepositoryNotFoundError, GatedRepoError, offline, HTTP ...
        raise SpecpairError(f"cannot fetch {model.describe()}: {type(exc).__name__}: {_first_line(exc)}") from exc
    if not (Path(path) / "config.json").is_file():
        raise SpecpairError(f"cannot fetch {model.describe()}: the snapshot holds no config.json "
                            f"(not a transformers model)")
    return Path(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def fetch_models(release: dict[str, Any], cache_dir: str | Path,
                 progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Put every model of the release into cache_dir (what is there is skipped), then write the
    release's completion marker. Returns the report (also the marker's content). A model that
    cannot be fetched raises SpecpairError naming the model, its source and why; nothing is
    marked complete then."""
    cache = ModelCache(cache_dir)
    digest = content_hash(release)
    to_fetch, nothing = release_models(release)
    results = list(nothing)
    for model in to_fetch:
        present = cache.present(model)
        if present is not None:
            progress(f"{model.role} {model.source}: present ({present})")
            results.append(Fetched(model.role, model.source, model.revision, model.kind, "present", present))
            continue
        started = time.monotonic()
        where = (_fetch_mlflow if model.kind == "mlflow" else _fetch_hub)(cache, model, progress)
        rel = str(where.relative_to(cache.root))
        seconds = round(time.monotonic() - started, 3)
        cache.write_json(cache.model_marker(model), {"source": model.source, "revision": model.revision,
                                                     "kind": model.kind, "path": rel})
        progress(f"{model.role} {model.source}: fetched into {rel} in {seconds:.1f} s")
        results.append(Fetched(model.role, model.source, model.revision, model.kind, "fetched", rel, seconds))
    report = {"digest": digest, "complete": True, "models": [asdict(r) for r in results]}
    cache.write_json(cache.release_marker(digest), report)
    return report


def is_complete(release: dict[str, Any], cache_dir: str | Path) -> bool:
    """Whether the release's completion marker is in cache_dir and each model it needs is there."""
    cache = ModelCache(cache_dir)
    if not cache.release_marker(content_hash(release)).is_file():
        return False
    to_fetch, _ = release_models(release)
    return all(cache.present(m) is not None for m in to_fetch)


def failure_report(release: dict[str, Any] | None, message: str) -> str:
    """What the fetch writes into its termination message when it fails (a few KiB at most)."""
    return json.dumps({"digest": content_hash(release) if release is not None else "",
                       "error": message[-1500:]})


def run(args) -> int:
    """The `specpair fetch-models` command."""
    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    release = None
    try:
        release = release_of(release_file=args.release, target=args.target, target_revision=args.target_revision,
                             draft=args.draft, draft_revision=args.draft_revision)
        report = fetch_models(release, args.cache_dir, progress)
    except SpecpairError as exc:
        if args.termination_log:
            Path(args.termination_log).write_text(failure_report(release, str(exc)), encoding="utf-8")
        raise
    if args.termination_log:
        Path(args.termination_log).write_text(json.dumps(
            {"digest": report["digest"], "fetched": sum(m["outcome"] == "fetched" for m in report["models"]),
             "present": sum(m["outcome"] == "present" for m in report["models"])}), encoding="utf-8")
    print(json.dumps(report))
    return 0


def add_parser(subparsers) -> None:
    f = subparsers.add_parser("fetch-models",
                              help="download a release's models into a shared model cache (hub-cache layout) "
                                   "that engine pods read offline")
    f.add_argument("--release", metavar="FILE", help="release file (as `specpair engine serve --release`)")
    f.add_argument("--target", help="target model source, without --release")
    f.add_argument("--target-revision", help="pinned revision of a hub target")
    f.add_argument("--draft", help="draft model or drafting head source, without --release")
    f.add_argument("--draft-revision", help="pinned revision of a hub draft")
    f.add_argument("--cache-dir", required=True,
                   help="the model cache (what engine pods mount as HF_HUB_CACHE)")
    f.add_argument("--termination-log", default=None,
                   help="also write a one-line JSON report here (the pod's termination message)")
    f.set_defaults(func=run)
