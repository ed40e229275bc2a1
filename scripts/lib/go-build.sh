# What the scripts that build Go programs into the cache share (sourced, not run): the Go version
# check, a stamp over exactly what decides the binaries, reuse of a build with that stamp, the
# compile with its progress lines, and the move of a finished build into place.
#
# A script sets, then calls go_build_init, go_build_reuse, go_build_compile, go_build_publish:
#   NAME        its name in messages ([NAME] ...)
#   CACHE_ROOT  the cache folder; a build lands in $CACHE_ROOT/<stamp>/bin
#   PROGRAMS    the programs the build must leave in bin/
#   GO_ENV      VAR=value pairs the go command runs with
#   GO_ARGS     the go command's arguments (build or install), without the output folder
#   STAMP_FILES files whose content decides the binaries besides GO_ENV and GO_ARGS (a go.mod, ...)
#
# The stamp hashes GO_ENV, GO_ARGS, STAMP_FILES and the Go version: a build is reused exactly while
# the command that made it is the same, and a comment edited in a script rebuilds nothing.

# Go >= 1.26: the modules these scripts build (Kubernetes v1.37, Prometheus 3.16, KEDA 2.21) need it.
go_build_init() {
  say() { printf '[%s] %s\n' "$NAME" "$*" >&2; }
  die() { printf '[%s] ERROR: %s\n' "$NAME" "$*" >&2; exit 1; }
  command -v go >/dev/null 2>&1 || die "Go is not on PATH. Install Go >= 1.26 (what $NAME builds needs it)."
  GO_VERSION="$(go env GOVERSION)"
  case "$GO_VERSION" in
    go1.2[6-9]*|go1.[3-9][0-9]*) ;;
    *) die "Go $GO_VERSION is too old: what $NAME builds needs Go >= 1.26." ;;
  esac
}

# One build of a stamp ($OUT) at a time: a second caller (a test fixture that found no binaries
# while scripts/test.sh's build ran) waits for the first and then reuses its result. Without the
# lock the second one's compile emptied the first one's $OUT.partial (and a source copy beside it)
# and both compiled the same packages (seen 2026-12-07: three cold control-plane builds at once,
# then two Traefik builds). Held on fd 9 until the script exits; a second call is a no-op.
go_build_lock() {
  [[ -n "${GO_BUILD_LOCKED:-}" ]] && return 0
  mkdir -p "$CACHE_ROOT"
  exec 9>"$OUT.lock"
  if ! flock -n 9; then
    say "another build of stamp $STAMP is running; waiting for it"
    flock 9
  fi
  GO_BUILD_LOCKED=1
}

# Sets STAMP, OUT and BIN; when a finished build with this stamp holds every program, prints BIN
# and exits the script.
go_build_reuse() {
  local what="$1"
  STAMP="$( { printf '%s\n' "$GO_VERSION" "${GO_ENV[@]}" -- "${GO_ARGS[@]}" --
              if (( ${#STAMP_FILES[@]} )); then cat "${STAMP_FILES[@]}"; fi; } | sha256sum | cut -c1-16)"
  OUT="$CACHE_ROOT/$STAMP"
  BIN="$OUT/bin"
  go_build_lock
  if [[ -f "$OUT/stamp" ]] && [[ "$(cat "$OUT/stamp")" == "$STAMP" ]]; then
    local p
    for p in "${PROGRAMS[@]}"; do [[ -x "$BIN/$p" ]] || return 0; done
    say "reusing $what built for stamp $STAMP"
    echo "$BIN"
    exit 0
  fi
}

# Runs the go command into $OUT.partial/bin (-o for build, GOBIN for install), niced so that a
# build beside other work leaves it the cores it asks for, at most GO_BUILD_PARALLEL (default:
# the CPU count) packages at a time. -v names each package as it is compiled; a line every 250
# shows a long build is alive. Returns the go command's exit status.
go_build_compile() {
  rm -rf "$OUT.partial"
  mkdir -p "$OUT.partial/bin"
  local out_args=(-o "$OUT.partial/bin/") env_args=()
  if [[ "${GO_ARGS[0]}" == install ]]; then out_args=(); env_args=("GOBIN=$OUT.partial/bin"); fi
  local status
  set +e
  env "${GO_ENV[@]}" "${env_args[@]}" nice -n "${GO_BUILD_NICE:-10}" \
      go "${GO_ARGS[0]}" -p "${GO_BUILD_PARALLEL:-$(nproc)}" "${out_args[@]}" "${GO_ARGS[@]:1}" 2>&1 | {
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
  return "$status"
}

# Checks every program is in $OUT.partial/bin, stamps the build, moves it to $OUT, prints BIN.
go_build_publish() {
  local p
  for p in "${PROGRAMS[@]}"; do [[ -x "$OUT.partial/bin/$p" ]] || die "the build produced no $p"; done
  echo "$STAMP" > "$OUT.partial/stamp"
  rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
  say "built in $((SECONDS - started)) s: ${PROGRAMS[*]}"
  echo "$BIN"
}
