#!/usr/bin/env bash
# Builds a real Gateway API implementation, Traefik, from the github.com/traefik/traefik/v3 Go
# module at a pinned version, and puts the Gateway API CRDs (standard channel, which holds
# HTTPRoute and GRPCRoute) from the sigs.k8s.io/gateway-api module beside it, into a cache outside
# the repository; prints the folder holding the binary on its last line.
#
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/gateway/<stamp>/bin/traefik
#   ${SPECPAIR_CACHE:-~/.cache/specpair}/gateway/<stamp>/crds/   the standard channel's CRDs
#
# Traefik's go.mod has `replace` directives (its forks of go-http-auth and mux), which
# `go install <package>@<version>` refuses, so the module is fetched with `go mod download` (its
# zip checked against the checksum database) and built from a writable copy with its own go.mod
# and go.sum, as Traefik's Makefile builds ./cmd/traefik (CGO off, the version stamped with -X).
# The web UI's compiled assets ship in the module (webui/static), so nothing runs npm.
#
# Two changes to what Traefik pins, because the Go module proxy answers 403 ("not available")
# for some modules it needs, and nothing but that proxy is reachable:
#   - github.com/containous/go-http-auth (Traefik's fork of abbot/go-http-auth, for its BasicAuth
#     and DigestAuth middlewares) -> abbot/go-http-auth v0.4.0 from the proxy plus
#     gateway/go-http-auth-compat.go (the fork's CheckSecret and RequireAuthStale);
#   - lego's table of DNS providers for ACME DNS-01 challenges (some 150, whose cloud SDKs are
#     over half of what Traefik compiles, and six of whose SDKs the proxy does not serve) is
#     replaced by one that knows none: a copy of lego v5.4.1 whose providers/dns/
#     zz_gen_dns_providers.go answers every name "unrecognized DNS provider", as it does an unknown
#     one. ACME's HTTP-01 and TLS-ALPN-01 challenges are untouched.
# Neither touches routing: the devcluster uses no auth middleware and no ACME. And Traefik's
# nested module ./pkg/config/dynamic/ext (not in the zip) is written as the repository has it.
#
# <stamp> hashes the go command, the Go version, the Gateway API version and those changes
# (scripts/lib/go-build.sh): a warm run only checks the stamp. Nothing is downloaded from anywhere
# but the Go module proxy. Cold build time: docs/devcluster.md.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
TRAEFIK_VERSION=v3.7.13
GATEWAY_API_VERSION=v1.6.3
MODULE=github.com/traefik/traefik/v3
NAME=build-gateway
PROGRAMS=(traefik)
CACHE_ROOT="${SPECPAIR_CACHE:-$HOME/.cache/specpair}/gateway"
go_build_init

LDFLAGS="-s -w -X=$MODULE/pkg/version.Version=${TRAEFIK_VERSION#v} -X=$MODULE/pkg/version.Codename=specpair"
LDFLAGS+=" -X=$MODULE/pkg/version.BuildDate=1970-01-01T00:00:00Z"
# GOFLAGS from the caller (-mod=vendor, say) would not apply to Traefik's module.
# -mod=mod: the copy's go.sum gains the sums its replaced modules' requirements need.
GO_ENV=(GOFLAGS=-mod=mod GOWORK=off CGO_ENABLED=0)
GO_ARGS=(build -v -trimpath -ldflags="$LDFLAGS" ./cmd/traefik)
# The CRDs' version decides the output folder as much as the go command does.
version_file="$(mktemp)"; trap 'rm -f "$version_file"' EXIT
LEGO_VERSION=v5.4.1
GO_HTTP_AUTH_VERSION=v0.4.0
COMPAT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib/go-http-auth-compat.go"
echo "gateway-api $GATEWAY_API_VERSION standard; lego $LEGO_VERSION without DNS providers; go-http-auth $GO_HTTP_AUTH_VERSION" > "$version_file"
STAMP_FILES=("$version_file" "$COMPAT")
crds_complete() { [[ -f "$OUT/crds/gateway.networking.k8s.io_httproutes.yaml" && -f "$OUT/crds/gateway.networking.k8s.io_grpcroutes.yaml" ]]; }
go_build_reuse_checked() {
  # go_build_reuse exits when the binary is there; a folder missing its CRDs is rebuilt.
  STAMP="$( { printf '%s\n' "$GO_VERSION" "${GO_ENV[@]}" -- "${GO_ARGS[@]}" --; cat "${STAMP_FILES[@]}"; } | sha256sum | cut -c1-16)"
  OUT="$CACHE_ROOT/$STAMP"
  go_build_lock   # before the check: a build under way is waited for, then reused
  if crds_complete; then go_build_reuse "Traefik $TRAEFIK_VERSION and Gateway API $GATEWAY_API_VERSION"; fi
  BIN="$OUT/bin"
}
go_build_reuse_checked

started=$SECONDS
say "building Traefik $TRAEFIK_VERSION (module) with $GO_VERSION into $OUT (cold: many minutes on 2 cores)"
download() {  # the module's folder in the module cache
  local dir
  dir="$(env "${GO_ENV[@]}" go mod download -json "$1" | awk -F'"' '$2 == "Dir" {print $4}')" \
    || die "could not download $1 (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  [[ -d "$dir" ]] || die "go mod download gave no module folder for $1"
  echo "$dir"
}
GATEWAY_API_SOURCE="$(download "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION")"
[[ -d "$GATEWAY_API_SOURCE/config/crd/standard" ]] || die "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION has no config/crd/standard"
TRAEFIK_SOURCE="$(download "$MODULE@$TRAEFIK_VERSION")"
LEGO_SOURCE="$(download "github.com/go-acme/lego/v5@$LEGO_VERSION")"
AUTH_SOURCE="$(download "github.com/abbot/go-http-auth@$GO_HTTP_AUTH_VERSION")"

# Writable copies, beside the output folder (go_build_compile empties $OUT.partial).
WORK="$OUT.src"
rm -rf "$WORK" && mkdir -p "$WORK"
cp -r "$TRAEFIK_SOURCE" "$WORK/traefik"
cp -r "$LEGO_SOURCE" "$WORK/lego"
cp -r "$AUTH_SOURCE" "$WORK/go-http-auth"
chmod -R u+w "$WORK"
cp "$COMPAT" "$WORK/go-http-auth/traefik_compat.go"
# v0.4.0 predates modules; a replacement folder needs a go.mod (its one import, x/crypto, Traefik
# requires anyway).
printf 'module github.com/abbot/go-http-auth\n\ngo 1.21\n' > "$WORK/go-http-auth/go.mod"
table="$WORK/lego/providers/dns/zz_gen_dns_providers.go"
grep -q '^func NewDNSChallengeProviderByName(name string) (challenge.Provider, error) {$' "$table" \
  || die "lego $LEGO_VERSION's DNS provider table is not what this script replaces (check it)"
cat > "$table" <<'GO'
// Replaced by specpair's scripts/build-gateway.sh: no DNS-01 providers in this build.

package dns

import (
	"fmt"

	"github.com/go-acme/lego/v5/challenge"
)

// NewDNSChallengeProviderByName knows no DNS provider in this build.
func NewDNSChallengeProviderByName(name string) (challenge.Provider, error) {
	return nil, fmt.Errorf("unrecognized DNS provider: %s (this Traefik build has no DNS-01 providers)", name)
}
GO
# ./pkg/config/dynamic/ext is a nested module of Traefik's repository (so not in its module zip)
# that its go.mod replaces by that folder: empty extension types (dynamic.HTTP and dynamic.Router
# embed them) for other builds of Traefik. The same empty types, as the repository has them.
mkdir -p "$WORK/traefik/pkg/config/dynamic/ext"
printf 'module github.com/traefik/traefik/dynamic/ext\n\ngo 1.24.0\n' > "$WORK/traefik/pkg/config/dynamic/ext/go.mod"
printf '%s\n' 'package ext' '' '// HTTP is a dynamic.HTTP extension.' 'type HTTP struct{}' '' \
  '// Router is a dynamic.Router extension.' 'type Router struct{}' > "$WORK/traefik/pkg/config/dynamic/ext/ext.go"
cd "$WORK/traefik"
env "${GO_ENV[@]}" go mod edit \
  -replace "github.com/abbot/go-http-auth=../go-http-auth" \
  -replace "github.com/go-acme/lego/v5=../lego"
SOURCE="$WORK/traefik"
say "module copy at $SOURCE; compiling (its dependencies come from the module proxy as needed)"
go_build_compile || die "go build failed (exit $?); the lines above say why (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
mkdir -p "$OUT.partial/crds"
# The standard channel only: the experimental CRDs would replace these with other schemas. The
# ValidatingAdmissionPolicy file is not a CRD (it guards upgrades across channels) and is left out.
cp "$GATEWAY_API_SOURCE"/config/crd/standard/gateway.networking.k8s.io_*.yaml "$OUT.partial/crds/"
rm -f "$OUT.partial/crds/gateway.networking.k8s.io_vap_safeupgrades.yaml"
chmod -R u+w "$OUT.partial/crds"
rm -rf "$WORK"
go_build_publish
