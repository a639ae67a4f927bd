"""Decode throughput on a GPU: Triton attention, eager vs CUDA graphs, against the roofline.

A random-weight Llama (default: Llama-3.2-1B's shape in bf16; no download) decodes
``--steps`` greedy steps at each batch size with every sequence ``--context`` tokens
deep, through ``DecodeGraphs`` (engine/model/runtime/cuda_graphs.py): persistent buffers, one
host sync per step (the sampled ids), eagerly and then replayed as CUDA graphs. Printed
per batch: tokens/s and ms per step in both modes; at batch 1 also the fraction of the
HBM roofline, (weight bytes + KV bytes read per step) / step time / the device's peak
bandwidth (from its memory clock and bus width, or ``--peak-gbs``).

    PYTHONPATH=. python bench/bench_gpu_decode.py                 # on a CUDA machine
    PYTHONPATH=. python bench/bench_gpu_decode.py --dry-run       # anywhere, no GPU

The dry run prints the byte plan of the requested model, then runs the same code path on
a tiny model on the CPU under the Triton interpreter (eager only; its speed means
nothing) and stops where CUDA is needed: allocating the real model, capturing graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
from bench_kernels import SMOLLM2  # the script's folder is on sys.path (bench/ is no package)

from engine.kv.accounting import KVShape, bytes_per_token
from engine.model.layers.attention import AttentionWeights
from engine.model.layers.decoder import DecoderModel, LayerWeights, ModelWeights
from engine.model.layers.linear import DenseLinear
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.spec import DEFAULT_ROPE, ModelSpec

PRESETS: dict[str, ModelSpec] = {
    "llama-1b": ModelSpec(
        model_type="llama",
        num_layers=16,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    # The dry run's smoke model: runs on the CPU under the Triton interpreter.
    "tiny": ModelSpec(
        model_type="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": SMOLLM2,
}


@dataclass(frozen=True)
class StepBytes:
    """HBM bytes one decode step must move at least: every weight once, every sequence's
    cached K/V once."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def weight_bytes(spec: ModelSpec, element: int) -> int:
    per_layer = spec.hidden_size * (spec.q_size + 2 * spec.kv_size)  # qkv
    per_layer += spec.q_size * spec.hidden_size  # o_proj
    per_layer += 3 * spec.hidden_size * spec.intermediate_size  # gate, up, down
    embed = spec.vocab_size * spec.hidden_size
    lm_head = 0 if spec.tie_word_embeddings else embed
    # The embedding lookup reads `batch` rows, the tied LM head reads the whole table.
    return element * (spec.num_layers * per_layer + embed + lm_head)


def step_bytes(spec: ModelSpec, kv: KVShape, element: int, batch: int, context: int) -> StepBytes:
    return StepBytes(weight_bytes(spec, element), batch * context * bytes_per_token(kv))


def random_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    from engine.model.kernels.triton.triton_kernels import TritonKernels

    def dense(rows: int, cols: int) -> DenseLinear:
        return DenseLinear(torch.randn(rows, cols, dtype=dtype, device=device) * cols**-0.5)

    def norm() -> torch.Tensor:
        return torch.ones(spec.hidden_size, dtype=dtype, device=device)

    hidden, inter = spec.hidden_size, spec.intermediate_size
    layers = [
        LayerWeights(
            attention=AttentionWeights(
                qkv=dense(spec.q_size + 2 * spec.kv_size, hidden),
                o_proj=dense(hidden, spec.q_size),
            ),
            mlp=GatedMLP(gate_up=dense(2 * inter, hidden), down=dense(hidden, inter)),
            input_norm=norm(),
            pre_mlp_norm=norm(),
        )
        for _ in range(spec.num_layers)
    ]
    embed = torch.randn(spec.vocab_size, hidden, dtype=dtype, device=device)
    weights = ModelWeights(embed, layers, norm(), DenseLinear(embed))
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, spec.head_dim, 2) / spec.head_dim))
    rope = RotaryEmbedding(inv_freq, 1.0, 16384, dtype, device)
    return DecoderModel(spec, weights, {DEFAULT_ROPE: rope}, TritonKernels(device))


def peak_bandwidth(device: torch.device, override_gbs: float | None) -> float:
    """Bytes/s: double-data-rate memory clock x bus width, unless overridden."""
    if override_gbs:
        return override_gbs * 1e9
    if device.type != "cuda":
        return float("nan")
    props = torch.cuda.get_device_properties(device)
    return 2.0 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8


def time_decode(graphs: object, batch: int, context: int, steps: int, block_ids: list) -> float:
    """Seconds per step over ``steps`` timed steps (after 3 warm-up steps)."""
    from engine.model.runtime.cuda_graphs import DecodeGraphs, DecodeRow

    assert isinstance(graphs, DecodeGraphs)
    tokens = [1] * batch
    for step in range(3 + steps):
        if step == 3:
            start = time.perf_counter()  # the tolist() below has synchronized
        rows = [DecodeRow(t, context + step, b) for t, b in zip(tokens, block_ids, strict=True)]
        tokens = graphs.logits(rows).argmax(dim=-1).tolist()  # the step's one host sync
    return (time.perf_counter() - start) / steps


def run_batch(args: argparse.Namespace, model: DecoderModel, kv: KVShape, batch: int) -> dict:
    from engine.model.runtime.cuda_graphs import DecodeGraphs

    max_len = args.context + args.steps + 8
    per_seq = -(-max_len // args.block_size)
    pool = KVPool(KVPoolLayout(kv, batch * per_seq, args.block_size), model.device)
    cache = PagedKVCache(pool, model.dtype)
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    result: dict = {"batch": batch}
    modes = ("eager", "graphs") if model.device.type == "cuda" else ("eager",)
    for mode in modes:
        graphs = DecodeGraphs(model, cache, batch, max_len, use_graphs=mode == "graphs")
        start = time.perf_counter()
        graphs.capture()
        capture_s = time.perf_counter() - start
        seconds = time_decode(graphs, batch, args.context, args.steps, blocks)
        result[mode] = {"ms_per_step": seconds * 1e3, "tokens_per_s": batch / seconds}
        if mode == "graphs":
            result[mode].update(capture_s=capture_s, capture_mib=graphs.capture_bytes / 2**20)
        del graphs
    del pool, cache
    torch.cuda.empty_cache()
    return result


def print_batch(result: dict) -> None:
    eager = result["eager"]
    line = (
        f"batch {result['batch']:4d}: eager {eager['tokens_per_s']:9.1f} tok/s "
        f"({eager['ms_per_step']:.3f} ms/step)"
    )
    graphs = result.get("graphs")
    if graphs is not None:
        line += (
            f" | graphs {graphs['tokens_per_s']:9.1f} tok/s ({graphs['ms_per_step']:.3f} "
            f"ms/step, captured in {graphs['capture_s']:.1f} s, {graphs['capture_mib']:.0f} "
            f"MiB) | graphs/eager {graphs['tokens_per_s'] / eager['tokens_per_s']:.2f}x"
        )
    print(line, flush=True)


def print_plan(args: argparse.Namespace, spec: ModelSpec, kv: KVShape, element: int) -> None:
    print(
        f"model {args.model}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, {args.dtype}, KV {kv.kv_dtype}"
    )
    for batch in args.batches:
        need = step_bytes(spec, kv, element, batch, args.context)
        print(
            f"  batch {batch:4d}: {need.weights / 1e9:.3f} GB weights + {need.kv / 1e9:.3f} GB "
            f"KV read per step at context {args.context}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="llama-1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--kv-dtype", choices=["auto", "int8", "fp8"], default="auto")
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128]
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-gbs", type=float, default=None, help="override peak HBM GB/s")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, touch no GPU")
    args = parser.parse_args()
    spec = PRESETS[args.model]
    dtype = getattr(torch, args.dtype)
    kv = spec.kv_shape(args.dtype if args.kv_dtype == "auto" else args.kv_dtype)
    element = torch.finfo(dtype).bits // 8
    print_plan(args, spec, kv, element)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_gpu_decode: no CUDA device (use --dry-run to check the code path)")
    if args.dry_run:
        dry_run(args)
        return
    report(args, spec, kv, element, dtype, torch.device("cuda"))


def dry_run(args: argparse.Namespace) -> None:
    """The benchmark's code path on a tiny model on the CPU (Triton interpreter)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    small = argparse.Namespace(**{**vars(args), "batches": [1, 3], "context": 20, "steps": 2})
    spec = PRESETS["tiny"]
    print("dry run: the same path on the tiny model, CPU, Triton interpreter, eager only")
    report(small, spec, spec.kv_shape("float32"), 4, torch.float32, torch.device("cpu"))
    print(
        "bench_gpu_decode: dry run stops here: the real model, CUDA graphs and the "
        "roofline need CUDA"
    )


def report(
    args: argparse.Namespace,
    spec: ModelSpec,
    kv: KVShape,
    element: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    model = random_model(spec, dtype, device)
    peak = peak_bandwidth(device, args.peak_gbs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}: peak HBM " + ("unknown" if peak != peak else f"{peak / 1e12:.2f} TB/s"))
    results = []
    for batch in args.batches:
        result = run_batch(args, model, kv, batch)
        print_batch(result)
        if batch == 1:
            print_roofline(result, step_bytes(spec, kv, element, 1, args.context), peak)
        results.append(result)
    if args.json:
        summary = {"device": name, "peak_bytes_per_s": peak, "args": vars(args)}
        with open(args.json, "w") as out:
            json.dump({**summary, "results": results}, out, indent=2)


def print_roofline(result: dict, need: StepBytes, peak: float) -> None:
    for mode in ("eager", "graphs"):
        if mode not in result:
            continue
        achieved = need.total / (result[mode]["ms_per_step"] / 1e3)
        result[mode]["roofline_fraction"] = achieved / peak
        print(
            f"  roofline at batch 1 ({mode}): {need.total / 1e9:.3f} GB/step / "
            f"{result[mode]['ms_per_step']:.3f} ms = {achieved / 1e12:.2f} TB/s = "
            f"{100 * achieved / peak:.0f}% of peak"
        )


if __name__ == "__main__":
    main()
