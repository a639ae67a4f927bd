"""Offline engine throughput: kvserve's EngineCore vs transformers generate(), same weights.

For each batch size B, B requests of ``--prompt-len`` random token ids each generate
exactly ``--output-len`` tokens greedily (EOS ignored). Both engines run the embedded
SmolLM2-135M-Instruct GGUF dequantized to ``--dtype``, side by side in one process.

Reported per engine and batch: wall time for the whole batch, output tokens per second
(B * output_len / wall), the decode-only rate (tokens after the first per request, over
the time after the last prefill), and that rate as a fraction of the bf16 compute ceiling
the issue quotes for this machine (about 1,400 tok/s).

With ``--repeats N`` every (engine, batch) runs N times, engines interleaved within each
repeat so that machine noise hits them alike, and the table shows medians. kvserve
variants are the cross product of ``--quantization``, ``--kernels`` and
``--batch-invariant`` (off, on or off,on: the cost of ``kvserve serve --batch-invariant``).

    .venv/bin/python bench/bench_engine.py                       # B = 1, 8, 32, 64
    .venv/bin/python bench/bench_engine.py --batches 1,8 --output-len 32 --hf-batches 1
    .venv/bin/python bench/bench_engine.py --quantization none,int8 --kernels torch,native \
        --repeats 3 --skip-transformers
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from engine.builder import build_engine, find_embedded_model
from engine.config import EngineArgs
from engine.request import Request, SamplingParams

CEILING_TOK_S = 1400.0


@dataclass
class Result:
    engine: str
    batch: int
    wall_s: float
    decode_s: float
    output_tokens: int
    decode_cpu_s: float = float("nan")  # process CPU time of the decode phase

    @property
    def decode_tok_cpu_s(self) -> float:
        """Decode tokens per second of process CPU time: with --threads 1 on a shared
        machine, the closest figure to the uncontended single-core rate."""
        return (self.output_tokens - self.batch) / self.decode_cpu_s

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        decode_tokens = self.output_tokens - self.batch  # the first token comes with prefill
        return decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def make_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, vocab - 100, (batch, prompt_len), generator=generator)
    return ids.tolist()


def run_kvserve(core, prompts: list[list[int]], output_len: int, label: str = "kvserve") -> Result:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request([Request(f"b{len(prompts)}-{i}", prompt, params)])
    produced = 0
    prefill_done = prefill_cpu = None
    while core.has_unfinished():
        deltas = core.step()
        produced += sum(len(d.new_token_ids) for d in deltas)
        if prefill_done is None and produced >= len(prompts):
            prefill_done, prefill_cpu = time.perf_counter(), time.process_time()
    end, end_cpu = time.perf_counter(), time.process_time()
    assert produced == len(prompts) * output_len, produced
    decode_s = end - (prefill_done or end)
    decode_cpu = end_cpu - (prefill_cpu or end_cpu)
    return Result(label, len(prompts), end - start, decode_s, produced, decode_cpu)


def run_transformers(model, prompts: list[list[int]], output_len: int) -> Result:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        start, start_cpu = time.perf_counter(), time.process_time()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        first, first_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        start, start_cpu = time.perf_counter(), time.process_time()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
        )
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    decode_s, decode_cpu = max(wall - first, 1e-9), max(cpu - first_cpu, 1e-9)
    return Result("transformers", len(prompts), wall, decode_s, produced, decode_cpu)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--hf-batches", default=None, help="default: same as --batches")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--quantization",
        default="none",
        help="comma-separated weight quantizations to run side by side, e.g. none,int8",
    )
    parser.add_argument(
        "--kernels", default="auto", help="comma-separated kernel backends: auto,native,torch"
    )
    parser.add_argument(
        "--batch-invariant",
        default="off",
        help="comma-separated: off, on (EngineArgs.batch_invariant)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per (engine, batch)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--skip-transformers", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in (args.hf_batches or args.batches).split(",")]
    max_batch = max(batches)
    seq_len = args.prompt_len + args.output_len
    engines = {}
    for quantization in args.quantization.split(","):
        for kernels, invariant in itertools.product(
            args.kernels.split(","), args.batch_invariant.split(",")
        ):
            label = _label(quantization, kernels, args.dtype)
            label += " invariant" if invariant == "on" else ""
            engines[label] = build_engine(
                EngineArgs(
                    dtype=args.dtype,
                    kv_cache_dtype=args.kv_cache_dtype,
                    quantization=quantization,
                    kernels=kernels,
                    batch_invariant=invariant == "on",
                    max_model_len=seq_len + 16,
                    num_kv_blocks=max_batch * (-(-(seq_len + 16) // 16)) + 8,
                    max_num_seqs=max_batch,
                    max_num_batched_tokens=max(2048, args.prompt_len),
                    swap_space_gib=0,
                )
            )
    first = next(iter(engines.values()))
    vocab = len(first.tokenizer)
    print(f"torch threads {torch.get_num_threads()}, dtype {first.dtype}, KV {first.kv_shape}")
    for label, built in engines.items():
        print(f"{label}: weights {built.weight_bytes / 2**20:.1f} MiB")
    results: list[Result] = []
    for batch in batches:  # engines alternate within each repeat: noise hits them alike
        prompts = make_prompts(batch, args.prompt_len, vocab)
        for _ in range(args.repeats):
            for label, built in engines.items():
                results.append(run_kvserve(built.core, prompts, args.output_len, label))
                print(_row(results[-1]), flush=True)
    del engines, first
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        path = find_embedded_model()
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype)
        ).eval()
        for batch in hf_batches:
            prompts = make_prompts(batch, args.prompt_len, vocab)
            for _ in range(args.repeats):
                results.append(run_transformers(model, prompts, args.output_len))
                print(_row(results[-1]), flush=True)
    print()
    print(f"medians of {args.repeats} run(s):")
    print(
        "| engine | batch | wall s | output tok/s | decode tok/s | decode / 1,400 ceiling "
        "| decode tok per CPU-s |"
    )
    print("|:--|--:|--:|--:|--:|--:|--:|")
    for row in _median_rows(results):
        print(row)


def _label(quantization: str, kernels: str, dtype: str) -> str:
    """The engine's row name: its weight format (the dtype's, unquantized) and kernels."""
    weights = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)
    weights = weights if quantization == "none" else quantization
    return f"kvserve {weights} {kernels}"


def _median_rows(results: list[Result]) -> list[str]:
    groups: dict[tuple[str, int], list[Result]] = {}
    for result in results:
        groups.setdefault((result.engine, result.batch), []).append(result)
    rows = []
    for (engine, batch), runs in groups.items():
        wall = statistics.median(r.wall_s for r in runs)
        out = statistics.median(r.tok_s for r in runs)
        decode = statistics.median(r.decode_tok_s for r in runs)
        cpu = statistics.median(r.decode_tok_cpu_s for r in runs)
        rows.append(
            f"| {engine} | {batch} | {wall:.1f} | {out:.1f} | {decode:.1f} | "
            f"{decode / CEILING_TOK_S:.1%} | {cpu:.1f} |"
        )
    return rows


def _row(r: Result) -> str:
    return (
        f"| {r.engine} | {r.batch} | {r.wall_s:.1f} | {r.tok_s:.1f} | {r.decode_tok_s:.1f} | "
        f"{r.decode_tok_s / CEILING_TOK_S:.1%} | {r.decode_tok_cpu_s:.1f} |"
    )


if __name__ == "__main__":
    main()
