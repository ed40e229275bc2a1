#!/usr/bin/env bash
# The GPU figures of docs/gpu.md, as one device session takes them (docs/measurements/gpu_*.json).
# The machine has torch and transformers but no network: the SmolLM2 GGUF (98 MB) travels in two
# halves, one per call, and the engine's other packages as wheels in .whl/.
#
#   bash bench/gpu_measure.sh steps      # the CUDA-graph tests ($TESTS, a pytest -k), then step
#                                          # costs of random-weight shapes ($SHAPES, default all
#                                          # three); keeps .gg/part00
#   bash bench/gpu_measure.sh heads      # heads' recorded drafting steps: their CUDA tests ($TESTS,
#                                          # a pytest -k, default eagle or medusa), then an EAGLE head's step
#                                          # and a Medusa round (random weights, $HEAD_VOCAB draft
#                                          # ids, default 32000) beside the target's, for $SHAPES
#                                          # (default SmolLM2 and Llama-8B; SHAPE@LAYER times a
#                                          # candidate layer alone); keeps .gg/part00
#   bash bench/gpu_measure.sh smollm2    # the real SmolLM2 (joins part00 and .gg/part01):
#                                          # bench vs hf-compiled, identity, batch 1 and 16,
#                                          # SmolLM2 as its own draft model,
#                                          # and where the loop's host time goes (loop_profile.py)
# Everything lands in $OUT (default out/gpu), logs beside the JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"

install_wheels() {
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
}

# The CUDA-graph tests chosen by pytest -k $1 (tests/engine/test_engine_cuda_graphs.py; skipped
# where there is no GPU), their log in $OUT/$2.
cuda_tests() {
    PYTHONPATH=/tmp/site:$PWD/engine:$PWD/tests timeout "${CHECK_TIMEOUT:-150}" $PY -m pytest -q \
        -p no:cacheprovider -o addopts= -k "$1" tests/engine/test_engine_cuda_graphs.py \
        > "$OUT/$2.log" 2>&1
    echo "cuda graph tests ($1) exit $?"; tail -15 "$OUT/$2.log"
}

# Step costs of the random-weight shapes $2.., with an EAGLE head of $1 draft ids and Medusa heads
# beside each (0: none). A shape written SHAPE@LAYER times a candidate fixed layer instead of
# the engine's (gpu_step_bench.py --layer), alone. One process per entry: they compile at once
# (16 cores) while the CUDA tests run, and time one at a time once the tests are done
# (--barrier: the tests are one more party).
step_benches() {
    local vocab=$1 tests_k=$2 tests_log=$3; shift 3
    local parties=$(( $# + 1 )) turns=/tmp/specpair-turns-$vocab
    rm -rf "$turns"
    for entry in "$@"; do
        shape=${entry%@*}; layer=engine; name=$shape; extra=(--head-vocab "$vocab")
        [ "$vocab" = 0 ] && extra+=(--medusa-heads 0)
        if [ "$entry" != "$shape" ]; then
            layer=${entry#*@}; name=${shape}_$layer; extra=(--head-vocab 0 --medusa-heads 0 --hf off)
        fi
        [ "$vocab" = 0 ] || [ "$entry" != "$shape" ] || name=${name}_head
        kmax=8; [ "$shape" = llama-1b ] && kmax=3
        timeout "${STEP_TIMEOUT:-420}" $PY bench/gpu_step_bench.py --shape "$shape" --k-max "$kmax" \
            --layer "$layer" "${extra[@]}" --barrier "$turns" --parties "$parties" \
            --out "$OUT/gpu_step_$name.json" > "$OUT/gpu_step_$name.log" 2>&1 &
    done
    cuda_tests "$tests_k" "$tests_log"
    mkdir -p "$turns" && touch "$turns/cuda-tests.ready"
    wait
    grep -h "step \|round\|Error\|error:" "$OUT"/gpu_step_*.log | grep -v "^USDT" | tail -40
}

case "${1:-}" in
steps)
    [ -f .gg/part00 ] && cp .gg/part00 /tmp/smollm2.part00
    install_wheels
    # The recorded CUDA graphs against the same layers called one by one, and greedy identity
    # under them.
    step_benches 0 "${TESTS:-not eagle and not medusa}" gpu_cuda_graph_tests \
        ${SHAPES:-smollm2-135m llama-1b llama-8b}
    ;;
heads)
    [ -f .gg/part00 ] && cp .gg/part00 /tmp/smollm2.part00
    install_wheels
    step_benches "${HEAD_VOCAB:-32000}" "${TESTS:-eagle or medusa}" gpu_cuda_graph_head_tests \
        ${SHAPES:-smollm2-135m llama-8b}
    ;;
smollm2)
    mkdir -p /tmp/llm
    gguf=/tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /tmp/smollm2.part00 .gg/part01 > "$gguf" || exit 1
    echo "a1231443440b107ff29f02bdb38c9d0a  $gguf" | md5sum -c || exit 1
    install_wheels
    export PYTHONPATH=/tmp/site:$PWD/engine SPECPAIR_CACHE=/tmp/specpair-cache
    [ "${BENCH:-on}" = on ] && timeout "${BENCH_TIMEOUT:-300}" $PY -m specpair bench --target "$gguf" --drafter ngram \
        --device cuda --dtype bfloat16 --compile on --no-hf --peer hf-compiled --runs 3 \
        --json --out "$OUT/gpu_bench_smollm2.json" > "$OUT/gpu_bench_smollm2.log" 2>&1
    echo "bench exit $?"; grep -v "^USDT" "$OUT/gpu_bench_smollm2.log" | tail -15
    # Speculation allowed at 16 rows (what it gains or costs there) and at the engine's default
    # of 8 (past it the target steps at one token), against a target-only server too.
    [ "${LOAD:-on}" = on ] && SPECPAIR_COMPILE=on timeout "${LOAD_TIMEOUT:-240}" $PY bench/load_bench.py --target "$gguf" \
        --device cuda --concurrency 1 16 --requests "${LOAD_REQUESTS:-48}" \
        --batch-size-threshold ${LOAD_THRESHOLDS:-16 8} --plain-server --json "$OUT/gpu_load_smollm2.json" \
        > "$OUT/gpu_load_smollm2.log" 2>&1
    echo "load exit $?"; grep -v "^USDT" "$OUT/gpu_load_smollm2.log" | tail -25
    # A draft model through the same engine: SmolLM2 drafting for itself (its steps at token
    # bucket 1, the target's at the speculating bucket), for what a draft model's step and round
    # cost under its own graphs, and identity; not a speedup claim (BENCH_DRAFT=off skips it).
    [ "${BENCH_DRAFT:-on}" = on ] && timeout "${BENCH_DRAFT_TIMEOUT:-200}" $PY -m specpair bench --target "$gguf" \
        --draft "$gguf" --device cuda --dtype bfloat16 --compile on --no-hf --runs 1 \
        --json --out "$OUT/gpu_bench_smollm2_draft.json" > "$OUT/gpu_bench_smollm2_draft.log" 2>&1
    echo "draft bench exit $?"; grep -v "^USDT" "$OUT/gpu_bench_smollm2_draft.log" | tail -15
    # Where the loop's host time goes now that the step is one replay (PROFILE=off skips it).
    [ "${PROFILE:-on}" = off ] && exit 0
    timeout "${PROFILE_TIMEOUT:-120}" $PY bench/loop_profile.py --target "$gguf" --drafter ngram \
        --device cuda --dtype bfloat16 --out "$OUT/gpu_loop_profile_smollm2.json" \
        > "$OUT/gpu_loop_profile_smollm2.log" 2>&1
    echo "profile exit $?"; grep -v "^USDT" "$OUT/gpu_loop_profile_smollm2.log" | head -40
    ;;
*)
    echo "usage: $0 steps|heads|smollm2" >&2; exit 2 ;;
esac
