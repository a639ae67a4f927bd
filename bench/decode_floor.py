"""The memory floor of a single-stream decode token, per weight format.

A batch-1 decode step streams the weights its few-row kernels read once
(``ModelWeights.decode_nbytes``: the projections' few-row copies, the norms, the LM head);
at the machine's read bandwidth that is the shortest a token can take. This loads the
embedded model in each format, measures the bandwidth (a torch sum over 512 MiB, all
threads, median of 9, before and after), and prints bytes and floor; the inter-token
latencies to hold against it come from a server run (bench/compare_servers.py).

    PYTHONPATH=. .venv/bin/python bench/decode_floor.py
    PYTHONPATH=. .venv/bin/python bench/decode_floor.py --dtype float32   # an AVX2-only CPU's
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_kernels import read_bandwidth
from engine.builder import build_engine
from engine.config import EngineArgs
from engine.model.weight_format import QUANTIZATION_METHODS


def decode_bytes(quantization: str, dtype: str) -> int:
    args = EngineArgs(dtype=dtype, quantization=quantization, num_kv_blocks=64, max_model_len=1024)
    return build_engine(args).core.runner.model.weights.decode_nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's"
    )
    dtype = parser.parse_args().dtype
    print(f"torch threads {torch.get_num_threads()}, dtype {dtype}")
    before = read_bandwidth(9)
    sizes = {name: decode_bytes(name, dtype) for name in QUANTIZATION_METHODS}
    after = read_bandwidth(9)
    print(f"read bandwidth {before / 1e9:.1f} GB/s before, {after / 1e9:.1f} GB/s after")
    print("| weights | bytes a decode token streams | floor at the lower | at the higher |")
    print("|---|---:|---:|---:|")
    low, high = sorted((before, after))
    for name, size in sizes.items():
        label = ("bf16" if dtype == "bfloat16" else "fp32") if name == "none" else name
        print(
            f"| {label} | {size / 1e6:.0f} MB | {size / low * 1e3:.2f} ms | "
            f"{size / high * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
