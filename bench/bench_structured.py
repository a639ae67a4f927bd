"""What constrained decoding costs: output tok/s with and without a JSON schema, the mask
work per step, and the compile time of a typical schema.

The embedded SmolLM2-135M in float32, driven through ``EngineCore`` (no HTTP). At each
concurrency (1, 8, 32) the same requests run with and without the schema, interleaved and
repeated (medians). The schema asks for at least 20 objects, so constrained requests run
to ``max_tokens`` exactly like the unconstrained ones (``ignore_eos``): both loads have the
same batches and token counts, and the only difference is the grammar work. On a shared
machine wall time is mostly other tenants, so tokens per CPU-second of this process (all
its threads) are reported beside tokens per second. Mask work per
step is the time the engine thread spends in ``GrammarDecoding.mask`` (sync, the fills
that were not ready, one apply) plus ``accept``, measured around those calls; the
next-token masks filled ahead on the worker thread (beside the rest of the step) are
timed there and reported apart, with how many rows were ready in time. Compile times: a
fresh compiler per cold compile (median of 3), then the cached lookup (median of 1000).

    .venv/bin/python bench/bench_structured.py --out bench/results/structured
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch

from engine.builder import BuiltEngine, build_engine
from engine.config import EngineArgs
from engine.request import Request, SamplingParams, StructuredOutputs
from engine.structured import GrammarCompiler, GrammarDecoding

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "role": {"enum": ["engineer", "manager", "designer", "other"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "email", "city", "role", "tags"],
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 20}},
    "required": ["people"],
}
QUESTION = "List twenty people as JSON: name, age, email, city, role and tags for each."


class StepTimer:
    """Wraps a GrammarDecoding's mask and accept to time them per step."""

    def __init__(self, decoding: GrammarDecoding) -> None:
        self.samples: list[tuple[int, float]] = []  # (constrained rows, seconds)
        self._rows = 0
        self._seconds = 0.0
        mask, accept = decoding.mask, decoding.accept

        def timed_mask(logits: torch.Tensor, rows: Any) -> int:
            self._rows = sum(1 for r in rows if r.params.structured_outputs)
            start = time.perf_counter()
            result = mask(logits, rows)
            self._seconds = time.perf_counter() - start
            return result

        def timed_accept(rows: Any, tokens: Any) -> set[str]:
            start = time.perf_counter()
            result = accept(rows, tokens)
            self.samples.append((self._rows, self._seconds + time.perf_counter() - start))
            return result

        decoding.mask = timed_mask  # type: ignore[method-assign]
        decoding.accept = timed_accept  # type: ignore[method-assign]
        self.ahead: list[tuple[int, float]] = []  # (rows, seconds) of fills on the worker
        fill = decoding._fill

        def timed_fill(states: Any) -> None:
            start = time.perf_counter()
            fill(states)
            if threading.current_thread() is not threading.main_thread():
                self.ahead.append((len(states), time.perf_counter() - start))

        decoding._fill = timed_fill  # type: ignore[method-assign]
        self.decoding = decoding


def run_load(
    built: BuiltEngine, prompt: list[int], concurrency: int, max_tokens: int, grammar: bool
) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (all threads of this process) and output tokens for
    ``concurrency`` requests run to completion."""
    core = built.core
    spec = StructuredOutputs("json_schema", json.dumps(SCHEMA)) if grammar else None
    if spec is not None:
        assert built.grammar_compiler is not None
        built.grammar_compiler.compile(spec)  # as the server does, before submitting
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(concurrency):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            ignore_eos=True,
            structured_outputs=spec,
        )
        rid = f"{'g' if grammar else 'u'}-{concurrency}-{i}-{time.monotonic_ns()}"
        core.add_request([Request(rid, prompt, params, eos_token_ids=built.eos_token_ids)])
    tokens = 0
    while core.has_unfinished():
        tokens += sum(len(d.new_token_ids) for d in core.step())
    return time.perf_counter() - start, time.process_time() - cpu_start, tokens


def compile_times(built: BuiltEngine, repeats: int) -> dict[str, float]:
    spec = StructuredOutputs("json_schema", json.dumps(SCHEMA))
    cold = []
    for _ in range(repeats):
        compiler = GrammarCompiler(
            built.tokenizer,
            built.core.runner.model.spec.vocab_size,
            built.eos_token_ids,  # type: ignore[attr-defined]
        )
        start = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - start)
    cached = []
    for _ in range(1000):
        start = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - start)
    return {
        "cold_ms": statistics.median(cold) * 1e3,
        "cached_us": statistics.median(cached) * 1e6,
    }


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        model = platform.processor()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "flags": [
            f
            for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
            if f in flags.split()
        ],
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    info = machine()
    # The step-time bound off: its budget follows measured step times, so batches (and the
    # number of steps) would differ between the two loads; with a token budget they match.
    built = build_engine(
        EngineArgs(dtype="float32", enable_prefix_caching=False, max_step_time_ms=0)
    )
    runner: Any = built.core.runner
    timer = StepTimer(runner.grammar)
    chat = [{"role": "user", "content": QUESTION}]
    text = built.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = list(built.tokenizer.encode(text, add_special_tokens=False))
    compile_result = compile_times(built, repeats=3)
    print(
        f"compile: cold {compile_result['cold_ms']:.1f} ms, "
        f"cached {compile_result['cached_us']:.1f} us"
    )

    runs: dict[str, list[float]] = {}
    results: dict[str, Any] = {
        "machine": info,
        "compile": compile_result,
        "max_tokens": args.max_tokens,
    }
    for repeat in range(args.repeats):
        for concurrency in args.concurrency:
            # The first run after a change of concurrency is ~25% slower whatever its mode
            # (seen on this CPU in every repeat): an unmeasured run comes first.
            run_load(built, prompt, concurrency, args.max_tokens, grammar=False)
            modes = [False, True] if repeat % 2 == 0 else [True, False]
            for grammar in modes:
                seconds, cpu, tokens = run_load(
                    built, prompt, concurrency, args.max_tokens, grammar
                )
                key = f"{'grammar' if grammar else 'plain'}-c{concurrency}"
                runs.setdefault(key, []).append(tokens / seconds)
                runs.setdefault(f"{key}-cpu", []).append(tokens / cpu)
                print(
                    f"repeat {repeat} {key}: {tokens} tokens in {seconds:.2f} s "
                    f"= {tokens / seconds:.1f} tok/s, {tokens / cpu:.1f} tok/CPU-s, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            # Partial results survive an interrupted run.
            summarise(results, runs, timer, args.concurrency)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "bench_structured.json").write_text(
                    json.dumps(results, indent=2) + "\n"
                )
    for row in results["throughput"]:
        print(
            f"c={row['concurrency']:>3}: plain {row['plain_tok_s']:.1f} tok/s, "
            f"grammar {row['grammar_tok_s']:.1f} tok/s, ratio {row['ratio']:.3f}; per CPU-s "
            f"{row['plain_tok_per_cpu_s']:.1f} vs {row['grammar_tok_per_cpu_s']:.1f}, "
            f"ratio {row['cpu_ratio']:.3f}"
        )
    for rows, value in results["mask_ms_per_step_by_rows"].items():
        print(
            f"mask work at {rows} constrained rows: median {value['median_ms']:.3f} ms/step "
            f"({value['steps']} steps)"
        )
    for rows, value in results["fill_ahead_ms_by_rows"].items():
        print(f"filled ahead on the worker, {rows} rows: median {value['median_ms']:.3f} ms")
    print(
        f"rows whose mask was ready: {results['rows_filled_ahead']}, "
        f"filled in the step: {results['rows_filled_late']}"
    )
    print(json.dumps(info))


def summarise(
    results: dict[str, Any], runs: dict[str, list[float]], timer: StepTimer, levels: list[int]
) -> None:
    table = []
    for concurrency in levels:
        plain = runs.get(f"plain-c{concurrency}")
        grammar = runs.get(f"grammar-c{concurrency}")
        if not plain or not grammar:
            continue
        plain_median, grammar_median = statistics.median(plain), statistics.median(grammar)
        plain_cpu = statistics.median(runs[f"plain-c{concurrency}-cpu"])
        grammar_cpu = statistics.median(runs[f"grammar-c{concurrency}-cpu"])
        table.append(
            {
                "concurrency": concurrency,
                "plain_tok_s": plain_median,
                "grammar_tok_s": grammar_median,
                "ratio": grammar_median / plain_median,
                "plain_tok_per_cpu_s": plain_cpu,
                "grammar_tok_per_cpu_s": grammar_cpu,
                "cpu_ratio": grammar_cpu / plain_cpu,
                "repeats": min(len(plain), len(grammar)),
            }
        )
    results["throughput"] = table
    results["runs"] = runs
    mask_ms = {}
    for rows in sorted({r for r, _ in timer.samples}):
        values = [s * 1e3 for r, s in timer.samples if r == rows]
        mask_ms[str(rows)] = {"median_ms": statistics.median(values), "steps": len(values)}
    results["mask_ms_per_step_by_rows"] = mask_ms
    ahead_ms = {}
    for rows in sorted({r for r, _ in timer.ahead}):
        values = [s * 1e3 for r, s in timer.ahead if r == rows]
        ahead_ms[str(rows)] = {"median_ms": statistics.median(values), "fills": len(values)}
    results["fill_ahead_ms_by_rows"] = ahead_ms
    results["rows_filled_ahead"] = timer.decoding.rows_filled_ahead
    results["rows_filled_late"] = timer.decoding.rows_filled_late
    results["machine"]["loadavg_end"] = os.getloadavg()


if __name__ == "__main__":
    main()
