#!/usr/bin/env bash
# Regenerate the Python stubs for protos/ into engine/specpair/_proto/ (or into $1).
#
# The stubs are committed so a fresh clone works without grpcio-tools; run this after editing a
# .proto (tests/server/test_server_cli.py fails while the committed stubs are stale).
# protoc names modules after the proto path (specpair.engine.v1.engine_pb2); we ship them as
# specpair._proto.engine_pb2, so the one cross-module import in the gRPC stub is rewritten.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/engine/specpair/_proto}"
python="${PYTHON:-python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m grpc_tools.protoc -I "$root/protos" \
  --python_out="$work" --pyi_out="$work" --grpc_python_out="$work" \
  specpair/engine/v1/engine.proto

mkdir -p "$out"
for f in engine_pb2.py engine_pb2.pyi engine_pb2_grpc.py; do
  sed -e 's/^from specpair\.engine\.v1 import engine_pb2 as/from specpair._proto import engine_pb2 as/' \
    "$work/specpair/engine/v1/$f" > "$out/$f"
done
[ -f "$out/__init__.py" ] || printf '"""Generated gRPC stubs for protos/ (scripts/gen-protos.sh). Do not edit."""\n' > "$out/__init__.py"
