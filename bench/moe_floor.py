"""How close a mixture of experts can come to its dense twin at a batch: the bytes floor.

At 32 sequences a 32-expert, top-4 layer is asked for nearly every expert (128 token-expert
pairs), so a decode step streams almost all expert weights, where the dense twin streams
one MLP of the active size. Where the dense step is not compute-bound (AMX bf16 GEMMs) the
MoE cannot come closer than

    (dense step - dense MLP time + expert bytes the step touches / read bandwidth) / dense step

This runs bench/bench_moe.py's two models through the engine (build them first with it)
at ``--batch`` sequences, times the dense twin's step and its MLP calls, counts the experts
each MoE layer's router picks in the same decode, reads the bandwidth, and prints that
floor next to the measured MoE / dense ratio.

    PYTHONPATH=. .venv/bin/python bench/moe_floor.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.bench_engine import make_prompts, run_kvserve
from bench.bench_kernels import read_bandwidth
from engine.builder import build_engine
from engine.config import EngineArgs
from engine.model.layers.linear import parameter_bytes
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.moe import MoEMLP
from engine.model.layers.routing import route


class MlpTimer:
    """Wraps GatedMLP.__call__ for one run: seconds spent in calls of ``rows`` rows."""

    def __init__(self, rows: int) -> None:
        self.rows, self.seconds, self._call = rows, 0.0, GatedMLP.__call__

    def __enter__(self) -> MlpTimer:
        timer, call = self, self._call

        def timed(mlp: GatedMLP, x: torch.Tensor, kernels: object) -> torch.Tensor:
            start = time.perf_counter()
            y = call(mlp, x, kernels)  # type: ignore[arg-type]
            if x.shape[0] == timer.rows:
                timer.seconds += time.perf_counter() - start
            return y

        GatedMLP.__call__ = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        GatedMLP.__call__ = self._call  # type: ignore[method-assign]


class ExpertCounter:
    """Wraps MoEMLP.__call__ for one run: bytes of the experts each ``rows``-row call routes to."""

    def __init__(self, rows: int) -> None:
        self.rows, self.bytes, self.calls, self._call = rows, 0, 0, MoEMLP.__call__

    def __enter__(self) -> ExpertCounter:
        counter, call = self, self._call

        def counted(mlp: MoEMLP, x: torch.Tensor, kernels: object) -> torch.Tensor:
            if x.shape[0] == counter.rows:
                _, ids = route(mlp.router(True)(x), mlp.routing)
                chosen = torch.unique(ids).tolist()
                counter.bytes += parameter_bytes([mlp.experts[e] for e in chosen], decode=True)
                counter.calls += 1
            return call(mlp, x, kernels)  # type: ignore[arg-type]

        MoEMLP.__call__ = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        MoEMLP.__call__ = self._call  # type: ignore[method-assign]


def step_seconds(model: Path, args: argparse.Namespace) -> tuple[float, object]:
    engine_args = EngineArgs(
        model=str(model), dtype=args.dtype, quantization=args.quantization,
        num_kv_blocks=2048, max_model_len=1024,
    )  # fmt: skip
    core = build_engine(engine_args).core
    prompts = make_prompts(args.batch, args.prompt_len, args.vocab)
    run_kvserve(core, prompts, 8)  # warm-up
    return run_kvserve(core, prompts, args.output_len).decode_s / (args.output_len - 1), core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("build/moe-bench"))
    parser.add_argument("--name", default="32x256-top4", help="bench_moe.py's model suffix")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    steps = args.output_len - 1
    with MlpTimer(args.batch) as mlp:
        dense_s, _ = step_seconds(args.model_dir / f"dense-{args.name}", args)
    dense_mlp_s = mlp.seconds / (steps + 7)  # the warm-up's 7 decode steps are timed too
    moe_s, _ = step_seconds(args.model_dir / f"moe-{args.name}", args)
    with ExpertCounter(args.batch) as experts:
        step_seconds(args.model_dir / f"moe-{args.name}", args)
    layers_per_step = experts.calls / (steps + 7)  # warm-up and timed decode steps
    touched = experts.bytes / max(1, experts.calls) * layers_per_step
    bandwidth = read_bandwidth(9)
    floor_s = dense_s - dense_mlp_s + touched / bandwidth
    print(f"batch {args.batch}, {args.dtype}, weights {args.quantization}")
    print(f"dense step {dense_s * 1e3:.2f} ms, of which its MLPs {dense_mlp_s * 1e3:.2f} ms")
    print(f"MoE step {moe_s * 1e3:.2f} ms: {moe_s / dense_s:.2f}x the dense step")
    print(f"experts a step touches {touched / 1e6:.0f} MB, bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"bytes floor of the MoE step {floor_s * 1e3:.2f} ms: {floor_s / dense_s:.2f}x the dense")


if __name__ == "__main__":
    main()
