"""Paged prefill attention alone: one layer of the native op on a synthetic bf16 cache.

The shape defaults to the last 2,048-query chunk of a 7,567-token prompt on
SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, 16-token blocks): the chunk whose
attention dominates a long prompt's prefill. Prints the median time of ``--repeats``
calls, the causal FLOPs per second (4 FLOP a visible score: two products of
``head_dim`` multiply-adds) and, with ``--check``, the largest and mean difference from
torch's SDPA in float32 on the same cache. ``KVSERVE_CPU_ISA=avx512`` (or avx2) compares
the other kernels on one machine.

    .venv/bin/python bench/bench_prefill_kernel.py --repeats 15 --check
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.model.kernels import native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=7567, help="tokens, the chunk's included")
    parser.add_argument("--new", type=int, default=2048, help="query rows (the chunk)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--check", action="store_true", help="compare with float32 SDPA")
    args = parser.parse_args()
    if not native.load_native_ops():
        raise SystemExit(f"native ops unavailable: {native.native_ops_error()}")
    ops = torch.ops.kvserve
    heads, kv_heads, dim, new, context = (
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.new,
        args.context,
    )
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // args.block_size)
    cache_shape = (kv_heads, blocks, args.block_size, dim)
    key_cache = torch.randn(cache_shape, generator=generator).bfloat16()
    value_cache = torch.randn(cache_shape, generator=generator).bfloat16()
    qkv = (torch.randn(new, (heads + 2 * kv_heads) * dim, generator=generator) * 2).bfloat16()
    table = torch.arange(blocks, dtype=torch.long)[None]
    starts = torch.tensor([0, new], dtype=torch.long)
    computed = torch.tensor([context - new], dtype=torch.long)
    out = torch.empty(new, heads * dim, dtype=torch.bfloat16)
    scale = dim**-0.5

    def attend() -> None:
        ops.paged_prefill_attention(
            out,
            qkv,
            key_cache,
            value_cache,
            table,
            starts,
            computed,
            heads,
            kv_heads,
            scale,
            None,
            None,
        )

    attend()  # warm: first-touch of the buffers, thread start
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        attend()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    visible = new * (context - new) + new * (new + 1) / 2  # causal scores per head
    flops = 4 * visible * dim * heads
    print(
        f"AMX tiles: {ops.amx_available()}; {new} queries over {context} tokens, "
        f"{heads}/{kv_heads} heads, head_dim {dim}, {torch.get_num_threads()} threads"
    )
    print(
        f"median {median * 1e3:.1f} ms (min {min(seconds) * 1e3:.1f}) per layer, "
        f"{flops / median / 1e9:.0f} GFLOP/s causal"
    )
    if args.check:
        q = qkv[:, : heads * dim].float().view(new, heads, dim).transpose(0, 1)
        k = key_cache.float().reshape(kv_heads, -1, dim)[:, :context]
        v = value_cache.float().reshape(kv_heads, -1, dim)[:, :context]
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        mask = torch.arange(context)[None] <= torch.arange(context - new, context)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale
        )
        difference = (out.float() - expected.transpose(0, 1).reshape(new, heads * dim)).abs()
        print(f"vs float32 SDPA: max {difference.max():.2e}, mean {difference.mean():.2e}")


if __name__ == "__main__":
    main()
