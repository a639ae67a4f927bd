"""Long-prompt time to first token: the native flash-style prefill attention vs SDPA per chunk.

Both variants run the embedded SmolLM2-135M-Instruct with the native kernels in one process;
they differ only in prefill attention:

- ``paged``: ``torch.ops.kvserve.paged_prefill_attention``, all of a step's chunks in one
  call, the context read through the block tables in tiles with an online softmax;
- ``sdpa``: torch's ``scaled_dot_product_attention`` per chunk over a gathered copy of the
  context with a materialised causal mask (the path before the native kernel).

For every prompt length, one request of that many random token ids runs to its first token
(max_tokens 1, prefix cache off, chunked at ``--max-num-batched-tokens``); variants are
interleaved within each repeat and the table shows medians. ``--attention-only`` also times
the attention op alone for the last chunk of each prompt (all layers' worth: x num_layers).

    .venv/bin/python bench/bench_prefill.py --lengths 1024,4096,7567 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.model.kernels.base import TorchKernels
from engine.model.kernels.metadata import SequenceChunk, build_metadata
from engine.model.kernels.native import NativeKernels
from engine.model.kernels.params import AttentionParams
from engine.request import Request, SamplingParams


class SdpaPrefillKernels(NativeKernels):
    """The native kernels with prefill attention done by torch's SDPA (the old path)."""

    def prefill_attention(self, cache, layer, qkv, meta, spec, params):  # type: ignore[no-untyped-def]
        return TorchKernels.prefill_attention(self, cache, layer, qkv, meta, spec, params)


def cpu_description() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in flags.splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    found = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f" {f}" in flags
    ]
    return f"{model}; {os.cpu_count()} CPUs; flags: {', '.join(found)}; load {os.getloadavg()}"


def time_to_first_token(core, prompt: list[int], tag: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    core.add_request([Request(tag, prompt, params)])
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - start


def attention_seconds(model, cache, prompt_len: int, chunk: int, kernels) -> float:
    """One layer's prefill attention for the prompt's last chunk, times num_layers."""
    spec = model.spec
    blocks = list(range(-(-prompt_len // cache.block_size)))
    new = min(chunk, prompt_len)
    meta = build_metadata(
        [SequenceChunk(prompt_len - new, new, blocks)], cache.block_size, model.device
    )
    qkv = torch.randn(new, spec.q_size + 2 * spec.kv_size, dtype=model.dtype)
    params = AttentionParams(spec.head_dim**-0.5)
    kernels.prefill_attention(cache, 0, qkv, meta, spec, params)  # warm
    start = time.perf_counter()
    kernels.prefill_attention(cache, 0, qkv, meta, spec, params)
    return (time.perf_counter() - start) * spec.num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096,7567", help="prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    parser.add_argument("--dtype", default="float32", help="model dtype (forced, not auto)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--attention-only", action="store_true", help="also time the op alone")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    built = build_engine(
        EngineArgs(
            dtype=args.dtype,
            device="cpu",
            kernels="native",
            max_model_len=max(lengths) + 16,
            enable_prefix_caching=False,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    core = built.core
    model = core.runner.model
    variants = {"paged": NativeKernels(), "sdpa": SdpaPrefillKernels()}
    vocab = model.spec.vocab_size
    print(cpu_description())
    print(
        f"dtype {args.dtype}, chunk {args.max_num_batched_tokens} tokens, "
        f"threads {torch.get_num_threads()}"
    )
    times: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for length in lengths:
            prompt = torch.randint(
                100, vocab - 100, (length,), generator=torch.Generator().manual_seed(length)
            ).tolist()
            for name, kernels in variants.items():
                model.kernels = kernels
                seconds = time_to_first_token(core, prompt, f"{name}-{length}-{repeat}")
                times.setdefault((name, length), []).append(seconds)
    print(
        f"\n{'prompt':>7} | {'paged TTFT s':>12} | {'sdpa TTFT s':>11} | paged/sdpa | "
        "paged prefill tok/s"
    )
    for length in lengths:
        paged = statistics.median(times[("paged", length)])
        sdpa = statistics.median(times[("sdpa", length)])
        print(
            f"{length:>7} | {paged:>12.3f} | {sdpa:>11.3f} | {paged / sdpa:>10.2f} | "
            f"{length / paged:>10.0f}"
        )
    if args.attention_only:
        cache = core.runner.cache
        print(f"\nattention alone, last chunk x {model.spec.num_layers} layers (seconds):")
        for length in lengths:
            paged = attention_seconds(
                model, cache, length, args.max_num_batched_tokens, variants["paged"]
            )
            sdpa = attention_seconds(
                model, cache, length, args.max_num_batched_tokens, variants["sdpa"]
            )
            print(f"{length:>7} | paged {paged:.3f} | sdpa {sdpa:.3f} | ratio {paged / sdpa:.2f}")


if __name__ == "__main__":
    main()
