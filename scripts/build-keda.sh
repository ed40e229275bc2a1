#!/usr/bin/env bash
# Builds KEDA's operator and its metrics API server (the external metrics adapter) from the
# github.com/kedacore/keda/v2 Go module at a pinned version, into a cache outside the repository,
# and prints the folder holding them on its last line.
#
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/keda/<stamp>/bin/{keda,keda-adapter}
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/keda/<stamp>/config/   KEDA's own kustomize folders (CRDs,
#                                                               RBAC) from the same module
#
# KEDA's go.mod has `replace` directives, which `go install <package>@<version>` refuses, so the
# module is fetched with `go mod download` (its zip checked against the checksum database) and
# built inside the module cache's read-only copy with its own go.mod and go.sum, as KEDA's Makefile
# does (CGO off, the version stamped with -X; the binaries named as its images name them).
# <stamp> hashes the go command (which holds the version) and the Go version
# (scripts/lib/go-build.sh): a warm run only checks the stamp. Nothing is downloaded from anywhere
# but the Go module proxy. KEDA links every scaler it has (cloud SDKs, databases, queues): a
# cold build compiles about 3,700 packages; times in docs/devcluster.md.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
KEDA_VERSION=v2.21.0
MODULE=github.com/kedacore/keda/v2
NAME=build-keda
PROGRAMS=(keda keda-adapter)
CACHE_ROOT="${SPECPAIR_CACHE:-$HOME/.cache/specpair}/keda"
go_build_init

LDFLAGS="-s -w -X=$MODULE/version.Version=${KEDA_VERSION#v} -X=$MODULE/version.GitCommit=$KEDA_VERSION"
# GOFLAGS from the caller (-mod=vendor, say) would not apply to KEDA's module.
GO_ENV=(GOFLAGS= GOWORK=off CGO_ENABLED=0)
GO_ARGS=(build -v -trimpath -ldflags="$LDFLAGS" ./cmd/operator ./cmd/adapter)
STAMP_FILES=()
go_build_reuse "KEDA $KEDA_VERSION"

started=$SECONDS
say "building KEDA $KEDA_VERSION (module) with $GO_VERSION into $OUT (cold: many minutes on 2 cores)"
SOURCE="$(env "${GO_ENV[@]}" go mod download -json "$MODULE@$KEDA_VERSION" | awk -F'"' '$2 == "Dir" {print $4}')" \
  || die "could not download $MODULE@$KEDA_VERSION (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
[[ -f "$SOURCE/go.mod" ]] || die "go mod download gave no module folder for $MODULE@$KEDA_VERSION"
cd "$SOURCE"
say "module at $SOURCE; compiling (its dependencies come from the module proxy as needed)"
go_build_compile || die "go build failed (exit $?); the lines above say why (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
mv "$OUT.partial/bin/operator" "$OUT.partial/bin/keda"
mv "$OUT.partial/bin/adapter" "$OUT.partial/bin/keda-adapter"
cp -r "$SOURCE/config" "$OUT.partial/config" && chmod -R u+w "$OUT.partial/config"
go_build_publish
