"""Native paged attention with and without the per-layer variants (sliding window, logit
soft-capping, sinks): decode and prefill, one layer, on synthetic caches.

Prints, for each (cache dtype, variant), the median and fastest wall time of ``--repeats``
calls and their median CPU time (every thread's): on a shared machine, where a thread
waits for a core, the CPU time is the steadier measure of the work. ``--cold`` sweeps a
buffer larger than the last-level cache before every call, as a model's other layers
would: a window's K/V otherwise stays cached between calls where a whole context cannot.
The default variant passes no new argument at all, so the same script times a build from
before the variants existed; ``--window`` etc. add rows for those variants. Decode:
``--batch`` sequences of ``--context`` tokens; prefill: one ``--new``-row chunk ending at
``--context``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_attention_variants.py --window 512 --cold
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.model.kernels import native

CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def time_ms(
    fn: Callable[[], None], repeats: int, evict: torch.Tensor | None
) -> tuple[float, float, float]:
    """The median and fastest wall time and the median CPU time of ``repeats`` calls, in
    milliseconds; ``evict``, when given, is rewritten before each call (not timed)."""
    fn()  # warm: first touch of the buffers, thread start
    wall, cpu = [], []
    for _ in range(repeats):
        if evict is not None:
            evict.add_(1)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, min(wall) * 1e3, statistics.median(cpu) * 1e3


def make_cache(kv_dtype: str, shape: tuple[int, ...], generator: torch.Generator):
    """Key and value caches plus their scales (None unless int8)."""
    if kv_dtype == "int8":
        keys = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
        values = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
        key_scale = torch.rand(shape[:3], generator=generator) / 64
        value_scale = torch.rand(shape[:3], generator=generator) / 64
        return keys, values, key_scale, value_scale
    keys = torch.randn(shape, generator=generator).to(CACHE_DTYPES[kv_dtype])
    values = torch.randn(shape, generator=generator).to(CACHE_DTYPES[kv_dtype])
    return keys, values, None, None


def variant_args(name: str, args: argparse.Namespace, heads: int) -> dict[str, object]:
    if name == "default":
        return {}
    extra: dict[str, object] = {}
    if "window" in name:
        extra["window"] = args.window
    if "softcap" in name:
        extra["softcap"] = args.softcap
    if "sinks" in name:
        extra["sinks"] = torch.randn(heads, generator=torch.Generator().manual_seed(1))
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new", type=int, default=4096, help="prefill: query rows")
    parser.add_argument("--batch", type=int, default=8, help="decode: sequences")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kv-dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--window", type=int, default=0, help="also time this window")
    parser.add_argument("--softcap", type=float, default=0.0, help="also time this cap")
    parser.add_argument("--sinks", action="store_true", help="also time with sinks")
    parser.add_argument("--modes", default="decode,prefill")
    parser.add_argument("--cold", action="store_true", help="evict the caches before calls")
    args = parser.parse_args()
    evict = torch.zeros(32 << 20) if args.cold else None  # 128 MiB
    if not native.load_native_ops():
        raise SystemExit(f"native ops unavailable: {native.native_ops_error()}")
    ops = torch.ops.kvserve
    heads, kv_heads, dim, context = args.heads, args.kv_heads, args.head_dim, args.context
    variants = ["default"]
    variants += ["window"] if args.window else []
    variants += ["softcap"] if args.softcap else []
    variants += ["sinks"] if args.sinks else []
    generator = torch.Generator().manual_seed(0)
    per_seq = -(-context // args.block_size)
    scale = dim**-0.5
    print(
        f"{heads}/{kv_heads} heads, head_dim {dim}, block {args.block_size}, context {context}, "
        f"{torch.get_num_threads()} threads, AMX {ops.amx_available()}"
    )
    for kv_dtype in args.kv_dtypes.split(","):
        for mode in args.modes.split(","):
            sequences = args.batch if mode == "decode" else 1
            shape = (kv_heads, sequences * per_seq, args.block_size, dim)
            key_cache, value_cache, key_scale, value_scale = make_cache(kv_dtype, shape, generator)
            order = torch.randperm(sequences * per_seq, generator=generator)
            tables = order.view(sequences, per_seq).contiguous()
            model_dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
            rows = sequences if mode == "decode" else args.new
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator)
            qkv = qkv.to(model_dtype)
            out = torch.empty(rows, heads * dim, dtype=model_dtype)
            lens = torch.full((sequences,), context, dtype=torch.long)
            starts = torch.tensor([0, rows], dtype=torch.long)
            computed = torch.tensor([context - rows], dtype=torch.long)
            for variant in variants:
                extra = variant_args(variant, args, heads)
                if mode == "decode":
                    call = (out, qkv, key_cache, value_cache, tables, lens, heads, kv_heads)
                    op = ops.paged_decode_attention
                else:
                    call = (out, qkv, key_cache, value_cache, tables, starts, computed)
                    call += (heads, kv_heads)
                    op = ops.paged_prefill_attention
                call += (scale, key_scale, value_scale)

                def attend(op=op, call=call, extra=extra) -> None:
                    op(*call, **extra)

                median, fastest, cpu = time_ms(attend, args.repeats, evict)
                print(
                    f"{mode:8s} {kv_dtype:9s} {variant:8s} median {median:9.3f} ms, "
                    f"min {fastest:9.3f} ms, CPU {cpu:9.3f} ms"
                )


if __name__ == "__main__":
    main()
