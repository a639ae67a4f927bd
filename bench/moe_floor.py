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
from unittest.mock import patch

import torch

from bench.bench_engine import make_prompts, run_kvserve
from bench.bench_kernels import read_bandwidth
from engine.builder import build_engine
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.model.layers.linear import parameter_bytes
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.moe import MoEMLP
from engine.model.layers.routing import route

WARMUP_TOKENS = 8


class PerLayer:
    """A quantity summed over the calls of a step's size, as a per-step figure: the mean
    per call times the number of distinct layers called (steps that mix prefill rows in
    are not counted)."""

    def __init__(self) -> None:
        self.total, self.calls, self.layers = 0.0, 0, set[int]()

    def add(self, layer: object, value: float) -> None:
        self.total, self.calls = self.total + value, self.calls + 1
        self.layers.add(id(layer))

    def per_step(self) -> float:
        return self.total / max(1, self.calls) * len(self.layers)


def build(model: Path, args: argparse.Namespace) -> EngineCore:
    engine_args = EngineArgs(
        model=str(model), dtype=args.dtype, quantization=args.quantization,
        num_kv_blocks=2048, max_model_len=1024,
    )  # fmt: skip
    return build_engine(engine_args).core


def step_seconds(core: EngineCore, args: argparse.Namespace) -> float:
    """Seconds per decode step at ``args.batch`` sequences, after a short warm-up."""
    prompts = make_prompts(args.batch, args.prompt_len, args.vocab)
    run_kvserve(core, prompts, WARMUP_TOKENS)
    return run_kvserve(core, prompts, args.output_len).decode_s / (args.output_len - 1)


def dense_step(core: EngineCore, args: argparse.Namespace) -> tuple[float, float]:
    """The dense twin's seconds per decode step, and how many of them its MLPs take."""
    mlps, call = PerLayer(), GatedMLP.__call__

    def timed(mlp: GatedMLP, x: torch.Tensor, kernels: object) -> torch.Tensor:
        start = time.perf_counter()
        y = call(mlp, x, kernels)  # type: ignore[arg-type]
        if x.shape[0] == args.batch:
            mlps.add(mlp, time.perf_counter() - start)
        return y

    with patch.object(GatedMLP, "__call__", timed):
        return step_seconds(core, args), mlps.per_step()


def touched_expert_bytes(core: EngineCore, args: argparse.Namespace) -> float:
    """Bytes of the experts a decode step's routers pick, all MoE layers together."""
    experts, call = PerLayer(), MoEMLP.__call__

    def counted(mlp: MoEMLP, x: torch.Tensor, kernels: object) -> torch.Tensor:
        if x.shape[0] == args.batch:
            _, ids = route(mlp.router(True)(x), mlp.routing)
            chosen = [mlp.experts[e] for e in torch.unique(ids).tolist()]
            experts.add(mlp, parameter_bytes(chosen, decode=True))
        return call(mlp, x, kernels)  # type: ignore[arg-type]

    with patch.object(MoEMLP, "__call__", counted):
        run_kvserve(core, make_prompts(args.batch, args.prompt_len, args.vocab), args.output_len)
    return experts.per_step()


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
    dense_s, dense_mlp_s = dense_step(build(args.model_dir / f"dense-{args.name}", args), args)
    moe = build(args.model_dir / f"moe-{args.name}", args)
    moe_s = step_seconds(moe, args)
    touched = touched_expert_bytes(moe, args)  # after the timing: routing again costs time
    bandwidth = read_bandwidth(9)
    floor_s = dense_s - dense_mlp_s + touched / bandwidth
    print(f"batch {args.batch}, {args.dtype}, weights {args.quantization}")
    print(f"dense step {dense_s * 1e3:.2f} ms, of which its MLPs {dense_mlp_s * 1e3:.2f} ms")
    print(f"MoE step {moe_s * 1e3:.2f} ms: {moe_s / dense_s:.2f}x the dense step")
    print(f"experts a step touches {touched / 1e6:.0f} MB, bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"bytes floor of the MoE step {floor_s * 1e3:.2f} ms: {floor_s / dense_s:.2f}x the dense")


if __name__ == "__main__":
    main()
