#!/bin/sh
# The image's entrypoint: `kvserve serve`, with --model "$MODEL" when MODEL is set (a
# Hugging Face directory or a .gguf file, e.g. on a mounted volume); unset or empty serves
# the embedded SmolLM2-135M. The same setting as MODEL in deploy/kubernetes/deployment.yaml.
set -eu
if [ -n "${MODEL:-}" ]; then
    exec kvserve serve --model "$MODEL" "$@"
fi
exec kvserve serve "$@"
