"""Where a decode step's time goes, from py-spy's samples: Python, kernels, OpenMP waits.

py-spy samples the engine thread's stack (Python frames and, with ``--native``, the C/C++
frames under them); this script keeps the samples taken inside ``EngineCore.step`` and
sorts each by its innermost frame:

- python: a Python frame, or the interpreter and torch's Python binding and dispatch
  layers (libpython, libtorch_python, pybind11, c10's dispatcher): host work per step;
- kernels: compute in the ops themselves (kvserve's csrc, MKL, oneDNN, ATen's CPU loops);
- omp wait: inside libgomp (a parallel region's fork, or the thread waiting at its end for
  the other one to finish its share);
- other native: libc and the rest (allocation, memcpy).

Record, then read (the harness runs 2,000 greedy decode steps of one request):

    PYTHONPATH=. .venv/bin/py-spy record --native -r 200 -f raw -o /tmp/int4.txt -- \\
        .venv/bin/python bench/profile_decode_step.py --quantization int4 \\
        --no-torch-profiler --steps 2000
    .venv/bin/python bench/pyspy_share.py /tmp/int4.txt --top 10
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

STEP_FRAME = re.compile(r"(^|\.)step \(engine/core\.py:\d+\)$")
PYTHON_FRAME = re.compile(r"\.py:\d+\)$")
PYTHON_LIBRARIES = ("libpython", "libtorch_python", "pybind11", "c10::Dispatcher", "torch::jit")
KERNEL_LIBRARIES = ("kvserve_cpu_ops", "libtorch_cpu", "mkl", "dnnl", "libc10")


def classify(leaf: str) -> str:
    """The bucket of a sample whose innermost frame is ``leaf``."""
    if PYTHON_FRAME.search(leaf) or any(name in leaf for name in PYTHON_LIBRARIES):
        return "python"
    if "libgomp" in leaf:
        return "omp wait"
    if any(name in leaf for name in KERNEL_LIBRARIES):
        return "kernels"
    return "other native"


def read_samples(path: Path) -> list[tuple[list[str], int]]:
    """(frames root first, count) for every stack py-spy's raw format lists."""
    samples = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples.append((stack.split(";"), int(count)))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=0, help="also list the N commonest leaves")
    args = parser.parse_args()
    buckets: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for frames, count in read_samples(args.raw):
        if not any(STEP_FRAME.search(frame) for frame in frames):
            continue
        leaf = re.sub(r"^0x[0-9a-f]+ ", "", frames[-1])
        buckets[classify(leaf)] += count
        leaves[leaf[:110]] += count
    total = sum(buckets.values())
    if not total:
        raise SystemExit(f"no samples inside EngineCore.step in {args.raw}")
    print(f"{total} samples inside EngineCore.step")
    for name in ("python", "kernels", "omp wait", "other native"):
        print(f"  {name:<13} {100 * buckets[name] / total:5.1f}%")
    for leaf, count in leaves.most_common(args.top):
        print(f"{count:>7}  {leaf}")


if __name__ == "__main__":
    main()
