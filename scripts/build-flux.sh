#!/usr/bin/env bash
# Builds Flux's source-controller and kustomize-controller from their Go modules
# (github.com/fluxcd/source-controller and github.com/fluxcd/kustomize-controller) at a pinned
# version, into a cache outside the repository, and prints the folder holding them on its last line.
#
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/flux/<stamp>/bin/{source-controller,kustomize-controller}
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/flux/<stamp>/crds/   both controllers' CRDs (config/crd/bases)
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/flux/<stamp>/rbac/   their ClusterRoles (config/rbac/role.yaml)
#
# Both go.mod files replace their API module by `./api`, a nested module of the repository that is
# not in the module zip, and `go install <package>@<version>` refuses `replace` directives. So each
# module is fetched with `go mod download` (its zip checked against the checksum database), copied
# to a writable folder, its `./api` replace pointed at the API module downloaded at the same
# version, and built there with its own go.mod and go.sum, as its Dockerfile builds main.go (CGO
# off; the static tags of its Makefile). v1.9.x needs Go 1.26 (v1.10 asks for 1.27).
#
# One change to what source-controller pins, because the Go module proxy answers 403 ("not
# available") for github.com/fluxcd/pkg/artifact v0.18.3 (its artifact storage and file server)
# and nothing but that proxy is reachable: v0.18.0 of the same minor release, from the proxy.
# <stamp> hashes the go command, the Go version and the versions (scripts/lib/go-build.sh): a warm
# run only checks the stamp. Nothing is downloaded from anywhere but the Go module proxy. The two
# controllers link the cloud SDKs of Flux's auth and of SOPS; cold build time: docs/devcluster.md.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
FLUX_CONTROLLERS_VERSION=v1.9.6   # source-controller and kustomize-controller (Flux 2.9)
NAME=build-flux
PROGRAMS=(source-controller kustomize-controller)
CACHE_ROOT="${SPECPAIR_CACHE:-$HOME/.cache/specpair}/flux"
go_build_init

# GOFLAGS from the caller (-mod=vendor, say) would not apply to Flux's modules.
# -mod=mod: a copy's go.sum may gain sums for what its replaced API module requires.
GO_ENV=(GOFLAGS=-mod=mod GOWORK=off CGO_ENABLED=0)
GO_ARGS=(build -v -trimpath -tags netgo,osusergo,static_build -ldflags=-s\ -w .)
version_file="$(mktemp)"; trap 'rm -f "$version_file"' EXIT
ARTIFACT_PIN=github.com/fluxcd/pkg/artifact@v0.18.0
echo "fluxcd source-controller and kustomize-controller $FLUX_CONTROLLERS_VERSION; source-controller with $ARTIFACT_PIN" > "$version_file"
STAMP_FILES=("$version_file")
go_build_reuse_checked() {
  # go_build_reuse exits when the binaries are there; a folder missing its CRDs is rebuilt.
  STAMP="$( { printf '%s\n' "$GO_VERSION" "${GO_ENV[@]}" -- "${GO_ARGS[@]}" --; cat "${STAMP_FILES[@]}"; } | sha256sum | cut -c1-16)"
  OUT="$CACHE_ROOT/$STAMP"
  go_build_lock   # before the check: a build under way is waited for, then reused
  if [[ -f "$OUT/crds/source.toolkit.fluxcd.io_gitrepositories.yaml" && -f "$OUT/crds/kustomize.toolkit.fluxcd.io_kustomizations.yaml" ]]; then
    go_build_reuse "Flux's source-controller and kustomize-controller $FLUX_CONTROLLERS_VERSION"
  fi
  BIN="$OUT/bin"
}
go_build_reuse_checked

started=$SECONDS
say "building Flux's source-controller and kustomize-controller $FLUX_CONTROLLERS_VERSION (modules) with $GO_VERSION into $OUT (cold: many minutes on 2 cores)"
download() {  # the module's folder in the module cache
  local dir
  dir="$(env "${GO_ENV[@]}" go mod download -json "$1" | awk -F'"' '$2 == "Dir" {print $4}')" \
    || die "could not download $1 (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  [[ -d "$dir" ]] || die "go mod download gave no module folder for $1"
  echo "$dir"
}
WORK="$OUT.src"
rm -rf "$WORK" && mkdir -p "$WORK"
rm -rf "$OUT.partial"
for program in "${PROGRAMS[@]}"; do
  module="github.com/fluxcd/$program"
  source_dir="$(download "$module@$FLUX_CONTROLLERS_VERSION")"
  api_dir="$(download "$module/api@$FLUX_CONTROLLERS_VERSION")"
  grep -q "^replace $module/api => ./api\$" "$source_dir/go.mod" \
    || die "$module@$FLUX_CONTROLLERS_VERSION's go.mod no longer replaces its API module by ./api (check this script)"
  cp -r "$source_dir" "$WORK/$program"
  chmod -R u+w "$WORK/$program"
  cd "$WORK/$program"
  env "${GO_ENV[@]}" go mod edit -replace "$module/api=$api_dir"
  if [[ "$program" == source-controller ]]; then
    env "${GO_ENV[@]}" go mod edit -replace "${ARTIFACT_PIN%@*}=$ARTIFACT_PIN"
  fi
  say "$program: module copy at $WORK/$program; compiling (its dependencies come from the module proxy as needed)"
  # go_build_compile empties $OUT.partial: keep what the first program left.
  if [[ -d "$OUT.partial" ]]; then mv "$OUT.partial" "$OUT.done"; fi
  go_build_compile || die "go build of $program failed (exit $?); the lines above say why (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  if [[ -d "$OUT.done" ]]; then cp -r "$OUT.done/." "$OUT.partial/" && rm -rf "$OUT.done"; fi
  mkdir -p "$OUT.partial/crds" "$OUT.partial/rbac"
  cp "$source_dir"/config/crd/bases/*.yaml "$OUT.partial/crds/"
  cp "$source_dir/config/rbac/role.yaml" "$OUT.partial/rbac/$program.yaml"
  chmod -R u+w "$OUT.partial/crds" "$OUT.partial/rbac"
  say "$program built ($((SECONDS - started)) s so far)"
done
rm -rf "$WORK"
go_build_publish
