#!/usr/bin/env bash
# Tiered prefix cache under a long-conversation load: tiers off / host / host + disk,
# back to back, same seed and load. Device pool ~1/4 of the live histories.
#   MODEL=DIR_OR_GGUF bench/tiers_loadtest.sh [OUT_DIR]   (default bench/results/tiers;
#   MODEL unset: the embedded SmolLM2; HOST_GIB / SMALL_HOST_GIB size the host tier;
#   RUN="host" runs only the listed settings)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
OUT=${1:-bench/results/tiers}
PORT=${PORT:-8917}
DISK=$(mktemp -d /tmp/kvserve-tiers-XXXX)
mkdir -p "$OUT"
MODEL_FLAGS=()
[ -n "${MODEL:-}" ] && MODEL_FLAGS=(--model "$MODEL")
COMMON=("${MODEL_FLAGS[@]}" --kernels "${KERNELS:-auto}" --device cpu --dtype float32 --num-kv-blocks 320 --max-model-len 1024
        --max-num-seqs 64 --max-num-batched-tokens 1024 --swap-space 0 --port "$PORT")
LOAD=(-c 64 -n 64 -t 6 --user-len 32 --max-tokens 8 --ignore-eos --think-time 1
      --ramp-up 5 --seed 7 --duration "${DURATION:-240}" --drain-timeout 60 --no-progress)
declare -A TIERS=(
  [off]=""
  [host]="--kv-cache-host-size ${HOST_GIB:-1.0}"
  [host-disk]="--kv-cache-host-size ${SMALL_HOST_GIB:-0.25} --kv-cache-disk-dir $DISK --kv-cache-disk-size 2"
)
{ lscpu | grep 'Model name'; grep -o -w -E 'avx2|avx512_bf16|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$OUT/machine.txt"
for name in ${RUN:-off host host-disk}; do
  echo "== $name: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
  # shellcheck disable=SC2086
  nice -n 10 "$PY" -m server.cli serve "${COMMON[@]}" ${TIERS[$name]} --log-level info \
    > "$OUT/server-$name.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$pid" || { echo "server $name died"; exit 1; }; sleep 1
  done
  nice -n 10 "$PY" -m loadtest --url "http://127.0.0.1:$PORT" "${LOAD[@]}" \
    --json "$OUT/$name.json" --png "$OUT/$name.png" > "$OUT/$name.txt" 2>&1 || true
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^kvserve_(kv_tier|prefix_cache)' > "$OUT/$name.metrics" || true
  kill -TERM "$pid"; wait "$pid" || true
  echo "   done $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
done
rm -rf "$DISK"
