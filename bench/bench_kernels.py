"""Kernel micro-benchmarks: the native CPU ops against their torch counterparts.

Two measurements, each side by side in one process on SmolLM2-135M's shapes (9 query
heads, 3 KV heads, head_dim 64, 30 layers, hidden 576, intermediate 1536):

- decode attention per layer, native vs torch backend on the same paged cache, for each
  KV cache dtype; block tables are a random permutation of the pool (as a long-running
  server's are) and every call reads another layer, so the cache is cold as in a step;
- decode attention of a bf16 model on a bf16 cache (the served default), native only, with a
  step's worth of weights (96 MiB) read between passes so every layer's rows come from
  memory, against the read bandwidth measured beside it (``--only attention-bf16``);
- a whole model's worth of int8 linear layers at 1-8 rows: fbgemm's dynamic-quantized
  GEMM vs the few-row kernels (``torch.ops.kvserve.int8_linear``, float; and
  ``int8_linear_vnni``, integer, on CPUs with AVX512_VNNI);
- the decoder's projections (no LM head) at 1-256 rows: int8 as the engine runs it
  (row-major kernel up to 4 rows, fbgemm beyond) vs int4 (``torch.ops.kvserve.int4_linear``);
- a whole model's worth of bf16 linear layers (with the LM head) at 1-64 rows: torch's bf16
  GEMM (oneDNN) vs the few-row kernel (``torch.ops.kvserve.bf16_linear``) and, where the CPU
  has AMX-BF16, the AMX kernel, on CPUs with AVX512_BF16 only; with the read bandwidth of
  this machine beside it, and the GEMM ceiling: torch's own GEMM on the same shapes at 512
  rows, weights warm.

    .venv/bin/python bench/bench_kernels.py
    .venv/bin/python bench/bench_kernels.py --batch 32 --context 400 --repeats 5
    .venv/bin/python bench/bench_kernels.py --only bf16
    .venv/bin/python bench/bench_kernels.py --only attention-bf16 --batch 1 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial

import torch

from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import AttentionMetadata, SequenceChunk, build_metadata
from engine.model.kernels.native import NativeKernels, load_native_ops
from engine.model.kernels.params import AttentionParams
from engine.model.layers.linear import Int4Linear, Int8Linear, Linear
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout, PagedKVCache
from engine.model.spec import ModelSpec

SMOLLM2 = ModelSpec(
    model_type="llama",
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def filled_cache(kv_dtype: str, num_blocks: int, block_size: int) -> PagedKVCache:
    layout = KVPoolLayout(SMOLLM2.kv_shape(kv_dtype), num_blocks, block_size)
    pool = KVPool(layout, torch.device("cpu"))
    if pool.key_scale is not None and pool.value_scale is not None:
        pool.key.random_(-127, 128)
        pool.value.random_(-127, 128)
        pool.key_scale.uniform_(0, 0.02)
        pool.value_scale.uniform_(0, 0.02)
    else:
        pool.key.normal_()
        pool.value.normal_()
    return PagedKVCache(pool, torch.float32)


def decode_metadata(
    args: argparse.Namespace, min_blocks: int, run: int = 1
) -> tuple[AttentionMetadata, int]:
    """One decode row per sequence (``--batch`` of them, ``--context`` tokens each) and the
    pool's block count: each sequence's blocks in runs of ``run`` consecutive ids, the runs
    in random order (1: scattered, as a long-running server's are)."""
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = max(min_blocks, 2 * args.batch * blocks_per_seq) // run * run
    order = [r * run + i for r in torch.randperm(num_blocks // run).tolist() for i in range(run)]
    chunks = [
        SequenceChunk(args.context - 1, 1, order[i * blocks_per_seq : (i + 1) * blocks_per_seq])
        for i in range(args.batch)
    ]
    return build_metadata(chunks, args.block_size, torch.device("cpu")), num_blocks


def bench_attention(args: argparse.Namespace) -> None:
    spec = SMOLLM2
    meta, num_blocks = decode_metadata(args, min_blocks=4000)
    qkv = torch.randn(args.batch, spec.q_size + 2 * spec.kv_size)
    backends = {"native": NativeKernels(), "torch": TorchKernels()}
    print(f"decode attention per layer, B={args.batch}, context {args.context}")
    print("| KV cache dtype | native | torch | native speed-up |")
    print("|---|---:|---:|---:|")
    for kv_dtype in ("float32", "bfloat16", "int8"):
        cache = filled_cache(kv_dtype, num_blocks, args.block_size)
        per_layer = {
            name: median_seconds(
                partial(attend_all_layers, kernels, cache, qkv, meta), args.repeats
            )
            / spec.num_layers
            for name, kernels in backends.items()
        }
        speedup = per_layer["torch"] / per_layer["native"]
        print(
            f"| {kv_dtype} | {per_layer['native'] * 1e6:,.0f} us | "
            f"{per_layer['torch'] * 1e6:,.0f} us | {speedup:.1f}x |"
        )


def bench_attention_bf16(args: argparse.Namespace) -> None:
    spec = SMOLLM2
    run = args.block_runs
    meta, num_blocks = decode_metadata(args, min_blocks=1000, run=run)
    qkv = torch.randn(args.batch, spec.q_size + 2 * spec.kv_size).bfloat16()
    cache = filled_cache("bfloat16", num_blocks, args.block_size)
    weights = torch.ones(24 * 1024 * 1024)  # 96 MiB: about a step's weights, read between passes
    kernels = NativeKernels()

    def cold_pass() -> float:
        weights.sum()
        start = time.perf_counter()
        attend_all_layers(kernels, cache, qkv, meta)
        return time.perf_counter() - start

    cold_pass()  # warm-up
    per_layer = statistics.median(cold_pass() for _ in range(args.repeats)) / spec.num_layers
    bandwidth = read_bandwidth(args.repeats)
    kv_bytes = 2 * args.batch * args.context * spec.kv_size * 2  # keys and values, bf16
    print(
        f"decode attention, bf16 model on a bf16 cache, B={args.batch}, context "
        f"{args.context}, blocks in runs of {run}, cache cold: {per_layer * 1e6:,.1f} us a layer, "
        f"{kv_bytes / per_layer / 1e9:.1f} GB/s of K/V; read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, so {kv_bytes / bandwidth / per_layer:.0%} of it"
    )


def attend_all_layers(
    kernels: TorchKernels, cache: PagedKVCache, qkv: torch.Tensor, meta: AttentionMetadata
) -> None:
    spec = SMOLLM2
    for layer in range(spec.num_layers):
        kernels.decode_attention(
            cache, layer, qkv, meta, spec, AttentionParams(spec.head_dim**-0.5)
        )


def fbgemm_all(layers: list[Int8Linear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        torch.ops.quantized.linear_dynamic(inputs[layer.in_features], layer.packed, True)


def few_row_all(
    kernel: Callable[..., None], layers: list[Int8Linear], inputs: dict[int, torch.Tensor]
) -> None:
    """Every layer through one of the few-row int8 kernels (``torch.ops.kvserve.*``)."""
    for layer in layers:
        assert layer.rowwise is not None
        x = inputs[layer.in_features]
        kernel(torch.empty(x.shape[0], layer.out_features), x, *layer.rowwise)


def projection_shapes() -> list[tuple[int, int]]:
    """(out, in) of every decoder projection of SmolLM2-135M: fused QKV, O, gate-up, down."""
    spec = SMOLLM2
    return [
        (spec.q_size + 2 * spec.kv_size, spec.hidden_size),
        (spec.hidden_size, spec.q_size),
        (2 * spec.intermediate_size, spec.hidden_size),
        (spec.hidden_size, spec.intermediate_size),
    ] * spec.num_layers


def call_all(layers: list[Linear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer(inputs[layer.in_features])  # type: ignore[attr-defined]


def bench_int4_linear(args: argparse.Namespace) -> None:
    shapes = projection_shapes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = [torch.randn(o, i) for o, i in shapes]
        int8: list[Linear] = [Int8Linear.from_dense(w, rowwise=True) for w in weights]
        int4: list[Linear] = [Int4Linear.from_dense(w) for w in weights]
    mb8, mb4 = (sum(layer.nbytes for layer in group) / 1e6 for group in (int8, int4))
    print(
        f"\ndecoder projections of one step, int8 ({mb8:.0f} MB with both copies) vs int4 "
        f"({mb4:.0f} MB)"
    )
    print("| rows | int8 (engine path) | int4 | int4 speed-up |")
    print("|---:|---:|---:|---:|")
    for rows in (1, 2, 4, 8, 16, 32, 256):
        inputs = {i: torch.randn(rows, i) for _, i in shapes}
        a = median_seconds(partial(call_all, int8, inputs), args.repeats)
        b = median_seconds(partial(call_all, int4, inputs), args.repeats)
        print(f"| {rows} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {a / b:.2f}x |")


def bench_int8_linear(args: argparse.Namespace) -> None:
    spec = SMOLLM2
    shapes = [*projection_shapes(), (spec.vocab_size, spec.hidden_size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = [Int8Linear.from_dense(torch.randn(o, i), rowwise=True) for o, i in shapes]
    weight_bytes = sum(o * i for o, i in shapes)
    vnni = bool(torch.ops.kvserve.int8_vnni_supported())
    bandwidth = read_bandwidth(args.repeats)
    print(
        f"\nint8 linear layers of one decode step ({weight_bytes / 1e6:.0f} MB of weights); "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, so the floor is "
        f"{weight_bytes / bandwidth * 1e3:.2f} ms"
        + ("" if vnni else " (no AVX512_VNNI on this CPU: no VNNI column)")
    )
    print("| rows | fbgemm | float kernel | VNNI kernel |")
    print("|---:|---:|---:|---:|")
    for rows in (1, 2, 4, 8):
        inputs = {i: torch.randn(rows, i) for _, i in shapes}
        runs = [
            partial(fbgemm_all, layers, inputs),
            partial(few_row_all, torch.ops.kvserve.int8_linear, layers, inputs),
            *([partial(few_row_all, torch.ops.kvserve.int8_linear_vnni, layers, inputs)] * vnni),
        ]
        cells = [
            f"{t * 1e3:.1f} ms ({weight_bytes / t / 1e9:.1f} GB/s)"
            for t in (median_seconds(run, args.repeats) for run in runs)
        ]
        print(f"| {rows} | " + " | ".join(cells) + (" |" if vnni else " | - |"))


def read_bandwidth(repeats: int) -> float:
    """Bytes per second a torch sum reads from a 512 MiB float32 tensor (all threads):
    the memory roofline a batch-1 decode step streams its weights against."""
    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    seconds = median_seconds(lambda: data.sum(), repeats)
    return data.numel() * 4 / seconds


def bench_bf16_linear(args: argparse.Namespace) -> None:
    if not (load_native_ops() and torch.ops.kvserve.bf16_linear_supported()):
        print("\nbf16 linear: this CPU has no AVX512_BF16 (the kernel is not used here)")
        return
    spec = SMOLLM2
    shapes = [*projection_shapes(), (spec.vocab_size, spec.hidden_size)]
    weights = [torch.randn(o, i).to(torch.bfloat16) for o, i in shapes]
    weight_bytes = sum(w.numel() * 2 for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    bandwidth = read_bandwidth(args.repeats)
    amx = bool(torch.ops.kvserve.amx_available())
    print(
        f"\nbf16 linear layers of one decode step ({weight_bytes / 1e6:.0f} MB of weights); "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum of 512 MiB), so the floor "
        f"is {weight_bytes / bandwidth * 1e3:.2f} ms"
    )
    kernels: dict[str, Callable[..., None]] = {"native kernel": torch.ops.kvserve.bf16_linear}
    if amx:
        kernels["AMX kernel"] = torch.ops.kvserve.bf16_linear_amx
    print(f"| rows | torch (oneDNN) | {' | '.join(kernels)} |")
    print("|---:|---:|" + "---:|" * len(kernels))
    for rows in (1, 2, 4, 8, 16, 32, 48, 64):
        inputs = {i: torch.randn(rows, i).to(torch.bfloat16) for _, i in shapes}
        outs = [torch.empty(rows, w.shape[0], dtype=torch.bfloat16) for w in weights]

        def torch_all(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

        def kernel_all(
            kernel: Callable[..., None],
            inputs: dict[int, torch.Tensor] = inputs,
            outs: list[torch.Tensor] = outs,
        ) -> None:
            for w, out in zip(weights, outs, strict=True):
                kernel(out, inputs[w.shape[1]], w)

        cells = [median_seconds(torch_all, args.repeats)]
        cells += [median_seconds(partial(kernel_all, k), args.repeats) for k in kernels.values()]
        print(
            f"| {rows} | "
            + " | ".join(
                f"{t * 1e3:.2f} ms ({flops_per_row * rows / t / 1e9:.0f} GFLOP/s)" for t in cells
            )
            + " |"
        )
    print_gemm_ceiling(weights, flops_per_row, args.repeats)


def print_gemm_ceiling(weights: list[torch.Tensor], flops_per_row: int, repeats: int) -> None:
    """torch's own bf16 GEMM on the step's weight shapes at 512 rows, one matrix at a time
    and each repeated while warm: the compute ceiling a decode step's projections are held
    against (issue 38)."""
    rows = 512
    seconds = 0.0
    for shape in sorted({tuple(w.shape) for w in weights}):
        count = sum(tuple(w.shape) == shape for w in weights)
        w = torch.randn(*shape).to(torch.bfloat16)
        x = torch.randn(rows, shape[1]).to(torch.bfloat16)
        gemm = partial(torch.nn.functional.linear, x, w)
        seconds += count * median_seconds(gemm, repeats)
    print(
        f"bf16 GEMM ceiling: torch at {rows} rows, weights warm: "
        f"{flops_per_row * rows / seconds / 1e9:.0f} GFLOP/s"
    )


BENCHES = {
    "attention": bench_attention,
    "attention-bf16": bench_attention_bf16,
    "int8": bench_int8_linear,
    "int4": bench_int4_linear,
    "bf16": bench_bf16_linear,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="decode attention: sequences")
    parser.add_argument("--context", type=int, default=400, help="decode attention: tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--block-runs",
        type=int,
        default=1,
        help="attention-bf16: a sequence's blocks come in runs of this many consecutive ids",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHES), default=list(BENCHES), help="which parts"
    )
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for name in args.only:
        BENCHES[name](args)


if __name__ == "__main__":
    main()
