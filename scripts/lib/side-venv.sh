# What the scripts that keep a virtualenv of their own beside ours share (sourced, not run):
# setup-vllm.sh (vLLM for the CPU) and setup-speculators.sh (the EAGLE-3 head writer). Each such
# venv holds nothing of ours, pins what ours need not share, and is checked from / with -P so
# nothing of the caller's directory is imported by accident.
#
# A script sets, then calls side_venv_ready_or_continue, side_venv_create, pip_install ...,
# side_venv_verified:
#   WHAT   what the venv holds, in messages ("vLLM 0.32.0")
#   VENV   its folder; PY its python ($VENV/bin/python)
#   TORCH_VERSION  the torch the venv holds (both venvs hold PyPI's same build: pip's cache serves both)
#   CHECK  python lines run in the venv that append to `problems` what else is wrong (the versions
#          it must hold); torch's version, and that specpair is not importable there, are checked here

say() { echo "==> $*" >&2; }

# Quiet unless asked (`side_venv_ok say`): then it says what is wrong.
side_venv_ok() {
  [ -x "$PY" ] || return 1
  local out
  if out=$(cd / && "$PY" -P - 2>&1 <<CHECK
import sys, torch
problems = []
if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    problems.append(f"torch is {torch.__version__}, not $TORCH_VERSION")
$CHECK
try:
    import specpair  # noqa: F401  (nothing of ours belongs there)
    problems.append(f"specpair is importable there ({specpair.__file__})")
except ImportError:
    pass
print("; ".join(problems))
sys.exit(1 if problems else 0)
CHECK
  ); then
    return 0
  fi
  if [ "${1:-}" = say ]; then echo "$out" | tail -5 >&2; fi
  return 1
}

# Warm: only the check, then the venv's python as the last stdout line, and the script ends.
side_venv_ready_or_continue() {
  if side_venv_ok; then
    say "$WHAT ready in $VENV"
    echo "$PY"
    exit 0
  fi
  SIDE_VENV_START=$SECONDS
}

side_venv_create() {
  if [ ! -x "$PY" ]; then
    say "creating virtualenv $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" >&2
  fi
  "$PY" -m pip install -q --upgrade pip >&2
}

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

# After the installs: the check again (what is wrong, and exit 1), else the venv's python.
side_venv_verified() {
  if ! side_venv_ok; then
    say "the venv at $VENV is not usable ($WHAT, no specpair):"
    side_venv_ok say || true
    exit 1
  fi
  say "$WHAT ready in $VENV ($((SECONDS - SIDE_VENV_START)) s)"
  echo "$PY"
}
