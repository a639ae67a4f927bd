#!/usr/bin/env bash
# Builds llama.cpp's C++ `llama-server` (parallel slots) for bench/compare_servers.py from
# the llama.cpp sources vendored in the llama-cpp-python sdist, so the C++ server is the
# same llama.cpp as the `llamacpp` peer (llama-cpp-python's Python server).
#
#   bench/peers/setup_llama_server.sh [PREFIX]     # default PREFIX: /tmp/llama-server
#   python bench/compare_servers.py --servers llama-server --llama-server PREFIX/bin/llama-server
#
# It also installs `llama-quantize` and the sources' `convert_hf_to_gguf.py` (with the
# `conversion` and `gguf-py` packages it imports) under PREFIX, to turn a Hugging Face
# directory into a GGUF of any llama.cpp type (bench/bench_moe.py --serve):
#
#   python PREFIX/convert_hf_to_gguf.py DIR --outtype bf16 --outfile moe-bf16.gguf
#   PREFIX/bin/llama-quantize moe-bf16.gguf moe-q4_0.gguf Q4_0
#
# Needs cmake, a C++ compiler and pip (PyPI). About 6 minutes on two cores; GGML_NATIVE=ON
# tunes it for this CPU (the binary is not portable to older CPUs). LLAMA_CMAKE_ARGS adds
# cmake options: an AVX2-only build on an AVX-512 machine, for timing the AVX2 class there:
#
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
#       bench/peers/setup_llama_server.sh /tmp/llama-server-avx2
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PREFIX="${1:-/tmp/llama-server}"
JOBS="${JOBS:-$(nproc)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

python3 -m pip download --no-deps --no-binary :all: --dest "$WORK" \
    "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}"
tar -xzf "$WORK"/llama_cpp_python-"${LLAMA_CPP_PYTHON_VERSION}".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"

cmake -S "$SRC" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF \
    ${LLAMA_CMAKE_ARGS:-}
cmake --build "$WORK/build" --target llama-server llama-quantize -j "$JOBS"

mkdir -p "$PREFIX/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-quantize" "$PREFIX/bin/"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$PREFIX/"
"$PREFIX/bin/llama-server" --version
echo "llama-server: $PREFIX/bin/llama-server"
