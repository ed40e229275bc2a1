#!/usr/bin/env bash
# Builds the real Kubernetes control plane that devcluster runs (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler) from the Go modules pinned in devcluster/gobuild,
# into a cache outside the repository, and prints the folder holding them on its last line.
#
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/controlplane/<stamp>/bin/{etcd,kube-apiserver,...}
#
# <stamp> hashes go.mod, go.sum, the go command and the Go version (scripts/lib/go-build.sh): a
# warm run only checks the stamp (well under a second); a cold run downloads the modules from the
# Go module proxy and compiles (measured on 2 cores: see docs/devcluster.md). Nothing is
# downloaded from anywhere else.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/lib/go-build.sh"
MODULE_DIR="$REPO_ROOT/devcluster/gobuild"
NAME=build-control-plane
CACHE_ROOT="${SPECPAIR_CACHE:-$HOME/.cache/specpair}/controlplane"
PROGRAMS=(etcd kube-apiserver kube-controller-manager kube-scheduler)
PACKAGES=(go.etcd.io/etcd/server/v3 k8s.io/kubernetes/cmd/kube-apiserver
          k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler)
go_build_init

# The version the binaries report (kubectl version, helm's kubeVersion check): what Kubernetes'
# own build stamps in with -X, taken from go.mod.
K8S_VERSION="$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' "$MODULE_DIR/go.mod")"
K8S_MINOR="$(echo "$K8S_VERSION" | cut -d. -f2)"
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR"
  LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
GO_ENV=()
GO_ARGS=(build -v -trimpath -ldflags="$LDFLAGS" "${PACKAGES[@]}")
STAMP_FILES=("$MODULE_DIR/go.mod" "$MODULE_DIR/go.sum")
go_build_reuse "the control plane"

started=$SECONDS
say "building etcd and Kubernetes $K8S_VERSION with $GO_VERSION into $OUT (cold: minutes on 2 cores)"
cd "$MODULE_DIR"
say "downloading modules from $(go env GOPROXY | cut -d, -f1)"
if ! go mod download >"${TMPDIR:-/tmp}/build-control-plane-download.log" 2>&1; then
  tail -20 "${TMPDIR:-/tmp}/build-control-plane-download.log" >&2
  die "could not download the Go modules (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
fi
say "modules ready after $((SECONDS - started)) s; compiling"
go_build_compile || die "go build failed (exit $?); the lines above say why"
# go names the etcd binary after its module path without the /v3 suffix: "server".
if [[ -x "$OUT.partial/bin/server" ]]; then mv "$OUT.partial/bin/server" "$OUT.partial/bin/etcd"; fi
go_build_publish
