#!/usr/bin/env bash
# Builds the real Kubernetes control plane that devcluster runs (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler) from the Go modules pinned in devcluster/gobuild,
# into a cache outside the repository, and prints the folder holding them on its last line.
#
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/controlplane/<stamp>/bin/{etcd,kube-apiserver,...}
#
# <stamp> hashes go.mod, go.sum, this script and the Go version: a warm run only checks the stamp (well
# under a second); a cold run downloads the modules from the Go module proxy and compiles
# (measured on 2 cores: see docs/devcluster.md). Nothing is downloaded from anywhere else.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODULE_DIR="$REPO_ROOT/devcluster/gobuild"
CACHE_ROOT="${SPECPAIR_CACHE:-$HOME/.cache/specpair}/controlplane"
PROGRAMS=(etcd kube-apiserver kube-controller-manager kube-scheduler)
PACKAGES=(go.etcd.io/etcd/server/v3 k8s.io/kubernetes/cmd/kube-apiserver
          k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler)

say() { printf '[build-control-plane] %s\n' "$*" >&2; }
die() { printf '[build-control-plane] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null 2>&1 || die "Go is not on PATH. Install Go >= 1.26 (the modules in $MODULE_DIR/go.mod need it)."
GO_VERSION="$(go env GOVERSION)"
case "$GO_VERSION" in
  go1.2[6-9]*|go1.[3-9][0-9]*) ;;
  *) die "Go $GO_VERSION is too old: Kubernetes v1.37 needs Go >= 1.26." ;;
esac

STAMP="$(cat "$MODULE_DIR/go.mod" "$MODULE_DIR/go.sum" "${BASH_SOURCE[0]}" <(echo "$GO_VERSION") | sha256sum | cut -c1-16)"
OUT="$CACHE_ROOT/$STAMP"
BIN="$OUT/bin"
if [[ -f "$OUT/stamp" ]] && [[ "$(cat "$OUT/stamp")" == "$STAMP" ]]; then
  missing=0
  for p in "${PROGRAMS[@]}"; do [[ -x "$BIN/$p" ]] || missing=1; done
  if [[ $missing == 0 ]]; then
    say "reusing the control plane built for stamp $STAMP"
    echo "$BIN"
    exit 0
  fi
fi

started=$SECONDS
say "building etcd and Kubernetes $(grep -m1 'k8s.io/kubernetes v' "$MODULE_DIR/go.mod" | awk '{print $2}') with $GO_VERSION into $OUT (cold: minutes on 2 cores)"
cd "$MODULE_DIR"
say "downloading modules from $(go env GOPROXY | cut -d, -f1)"
if ! go mod download >"${TMPDIR:-/tmp}/build-control-plane-download.log" 2>&1; then
  tail -20 "${TMPDIR:-/tmp}/build-control-plane-download.log" >&2
  die "could not download the Go modules (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
fi
say "modules ready after $((SECONDS - started)) s; compiling"
rm -rf "$OUT.partial"
mkdir -p "$OUT.partial/bin"
# -v names each package as it is compiled; count them so a long build shows it is alive.
set +e
# The version the binaries report (kubectl version, helm's kubeVersion check): what Kubernetes'
# own build stamps in with -X, taken from go.mod.
K8S_VERSION="$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' go.mod)"
K8S_MINOR="$(echo "$K8S_VERSION" | cut -d. -f2)"
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR"
  LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
go build -v -trimpath -ldflags="$LDFLAGS" -o "$OUT.partial/bin/" "${PACKAGES[@]}" 2>&1 | {
  n=0
  while IFS= read -r line; do
    case "$line" in
      "#"*|"go: "*|*.go:*) printf '%s\n' "$line" >&2 ;;
      *) n=$((n + 1)); if (( n % 250 == 0 )); then say "$n packages compiled ($((SECONDS - started)) s)"; fi ;;
    esac
  done
}
status=${PIPESTATUS[0]}
set -e
[[ $status == 0 ]] || die "go build failed (exit $status); the lines above say why"
# go names the etcd binary after its module path without the /v3 suffix: "server".
if [[ -x "$OUT.partial/bin/server" ]]; then mv "$OUT.partial/bin/server" "$OUT.partial/bin/etcd"; fi
for p in "${PROGRAMS[@]}"; do [[ -x "$OUT.partial/bin/$p" ]] || die "the build produced no $p"; done
echo "$STAMP" > "$OUT.partial/stamp"
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
say "built in $((SECONDS - started)) s: ${PROGRAMS[*]}"
echo "$BIN"
