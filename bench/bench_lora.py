"""LoRA adapters against the base model alone: the cost of serving many fine-tunes in one
batch, on the embedded SmolLM2-135M.

Four random rank-``--rank`` adapters on every projection (q, k, v, o, gate, up, down) are
written once as PEFT directories under ``--adapter-dir``. Three configurations run the
same load, alternating, ``--repeats`` rounds, medians reported:

- ``base``: a server without ``--enable-lora``;
- ``lora, base requests``: ``--enable-lora --max-loras 4`` with the adapters loaded, every
  request on the base model (what enabling LoRA costs requests that use none);
- ``lora, 4 adapters``: the same server, the conversations spread over the four adapters.

By default through the engine in process (32 sequences of ``--prompt-len`` tokens,
``--output-len`` greedy tokens each; seconds per decode step). ``--serve`` runs
``kvserve serve`` and ``kvserve-loadtest`` instead: 32 conversations of 4 turns x 64 tokens,
history re-sent, the conversations spread over the adapters by ``--model a0,a1,a2,a3``.

    PYTHONPATH=. .venv/bin/python bench/bench_lora.py --out bench/results/lora
    PYTHONPATH=. .venv/bin/python bench/bench_lora.py --serve --out bench/results/lora
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_engine import make_prompts
from bench.bench_hybrid_kv import cpu_description, wait_healthy
from bench.bench_moe import load_run
from engine.builder import BuiltEngine, build_engine
from engine.config import EngineArgs, LoRAConfig
from engine.lora.targets import HF_MODULES, LoRATargets
from engine.request import Request, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = ("a0", "a1", "a2", "a3")
SPLIT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOADS = ("base", "lora, base requests", "lora, 4 adapters")


def write_adapters(targets: LoRATargets, root: Path, rank: int) -> dict[str, str]:
    """Random PEFT LoRA directories for a base with ``targets`` (every projection)."""
    from safetensors.torch import save_file

    paths = {}
    for seed, name in enumerate(ADAPTERS):
        path = root / f"{name}-r{rank}"
        paths[name] = str(path)
        if (path / "adapter_model.safetensors").exists():
            continue
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(targets.num_layers):
            for module in SPLIT_MODULES:
                projection_name, part = HF_MODULES[module]
                projection = targets.get(projection_name)
                assert projection is not None
                rows = projection.part_rows(part)[1]
                key = f"base_model.model.model.layers.{layer}.{_block(module)}.{module}"
                a = torch.randn(rank, projection.in_features, generator=generator) * 0.02
                b = torch.randn(rows, rank, generator=generator) * 0.02
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(SPLIT_MODULES),
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return paths


def _block(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def engine_args(args: argparse.Namespace, lora: LoRAConfig | None) -> EngineArgs:
    return EngineArgs(
        device="cpu",
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.output_len + 16,
        kv_cache_memory_gib=1.0,
        swap_space_gib=0,
        max_num_seqs=args.batch,
        lora=lora,
    )


def run_batch(built: BuiltEngine, prompts: list[list[int]], adapters: bool, length: int) -> float:
    """Seconds per decode step of one batch (each sequence on its adapter or the base)."""
    catalog = built.lora_catalog
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    core = built.core
    for index, prompt in enumerate(prompts):
        lora = catalog.get(ADAPTERS[index % 4]) if adapters and catalog is not None else None
        core.add_request([Request(f"q{time.monotonic_ns()}-{index}", prompt, params, lora=lora)])
    produced, decode_start = 0, None
    while core.has_unfinished():
        produced += sum(len(d.new_token_ids) for d in core.step())
        if decode_start is None and produced >= len(prompts):
            decode_start = time.perf_counter()
    assert decode_start is not None
    return (time.perf_counter() - decode_start) / (length - 1)


def measure_engine(args: argparse.Namespace) -> dict[str, Any]:
    probe = build_engine(engine_args(args, LoRAConfig(max_loras=4, max_lora_rank=args.rank)))
    runtime = probe.core.runner.lora  # type: ignore[attr-defined]
    paths = write_adapters(runtime.targets, args.adapter_dir, args.rank)
    del probe
    lora = LoRAConfig(max_loras=4, max_lora_rank=args.rank, modules=tuple(paths.items()))
    engines = {"base": build_engine(engine_args(args, None))}
    engines["lora"] = build_engine(engine_args(args, lora))
    vocab = engines["base"].core.runner.model.spec.vocab_size  # type: ignore[attr-defined]
    prompts = make_prompts(args.batch, args.prompt_len, vocab)
    runs = {
        "base": (engines["base"], False),
        "lora, base requests": (engines["lora"], False),
        "lora, 4 adapters": (engines["lora"], True),
    }
    steps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (built, adapters) in runs.items():
            steps[name].append(run_batch(built, prompts, adapters, args.output_len))
    return {
        "seconds_per_step": steps,
        "weight_bytes": {name: built.weight_bytes for name, built in engines.items()},
    }


def server_command(args: argparse.Namespace, port: int, paths: dict[str, str] | None) -> list[str]:
    command = [
        sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--dtype", args.dtype,
        "--max-model-len", "4096", "--kv-cache-memory", "1", "--swap-space", "0",
        "--max-num-seqs", "32", "--served-model-name", "base",
    ]  # fmt: skip
    if paths:
        modules = [f"{name}={path}" for name, path in paths.items()]
        command += ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank)]
        command += ["--lora-modules", *modules]
    return command


def measure_served(args: argparse.Namespace) -> dict[str, Any]:
    probe = build_engine(engine_args(args, LoRAConfig(max_loras=4, max_lora_rank=args.rank)))
    paths = write_adapters(probe.core.runner.lora.targets, args.adapter_dir, args.rank)  # type: ignore[attr-defined]
    del probe
    port, out = 8753, args.out
    url = f"http://127.0.0.1:{port}"
    servers = {"base": (server_command(args, port, None), ("base",))}
    lora_runs = ("base", ",".join(ADAPTERS))
    servers["lora"] = (server_command(args, port, paths), lora_runs)
    names = {("base", "base"): "base", ("lora", "base"): "lora, base requests"}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in WORKLOADS}
    for round_index in range(args.repeats):
        for server_name, (command, models) in servers.items():
            log = (out / f"serve-{server_name}.log").open("a")
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                wait_healthy(url, server)
                for model in models:
                    workload = names.get((server_name, model), "lora, 4 adapters")
                    run_file = out / f"load-{workload.replace(' ', '_')}-{round_index}.json"
                    results[workload].append(load_run(url, 32, run_file, turns=4, model=model))
            finally:
                server.terminate()
                server.wait(timeout=60)
    return {"served": results}


def format_engine(summary: dict[str, Any]) -> str:
    steps = summary["seconds_per_step"]
    base = statistics.median(steps["base"])
    lines = [
        f"CPU: {summary['cpu']}",
        f"weights: base {summary['weight_bytes']['base']:,} B, with 4 slots of rank "
        f"{summary['rank']} {summary['weight_bytes']['lora']:,} B",
        "",
        f"| workload ({summary['batch']} sequences) | ms / decode step | tokens/s | vs base |",
        "|---|---:|---:|---:|",
    ]
    for name, values in steps.items():
        step = statistics.median(values)
        rate = summary["batch"] / step
        lines.append(f"| {name} | {step * 1e3:.1f} | {rate:.0f} | {base / step:.2f}x |")
    return "\n".join(lines)


def format_served(summary: dict[str, Any]) -> str:
    runs = summary["served"]
    base = statistics.median(r["output_tokens_per_s"] for r in runs["base"])
    lines = [
        f"CPU: {summary['cpu']}",
        "",
        "| workload (32 conversations) | output tok/s | ITL p50 ms | TTFT p50 ms | vs base |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in runs.items():
        rate = statistics.median(r["output_tokens_per_s"] for r in values)
        itl = statistics.median(r["itl_p50_s"] for r in values) * 1e3
        ttft = statistics.median(r["ttft_p50_s"] for r in values) * 1e3
        lines.append(f"| {name} | {rate:.1f} | {itl:.1f} | {ttft:.0f} | {rate / base:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="through kvserve serve + loadtest")
    parser.add_argument("--adapter-dir", type=Path, default=ROOT / "build" / "lora-bench")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = measure_served(args) if args.serve else measure_engine(args)
    summary |= {"cpu": cpu_description(), "rank": args.rank, "batch": args.batch}
    name = "served" if args.serve else "engine"
    (args.out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    table = format_served(summary) if args.serve else format_engine(summary)
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
