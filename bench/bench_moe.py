"""A mixture of experts against a dense model of the same active size, through the real
engine: time per output token at batch 1 and at 32 sequences.

Two random models share everything but the feed-forward (Qwen3 layers, SmolLM2's
vocabulary and tokenizer, ``--layers`` layers of hidden size ``--hidden``): the MoE has
``--experts`` experts of width ``--expert-width`` a layer, ``--top-k`` of them per token
(Qwen3-MoE); the dense twin one MLP of width ``top_k * expert_width``, so both compute the
same active parameters per token. Each is saved once under ``--model-dir`` and served by
``build_engine`` as ``kvserve serve`` would; runs alternate between the two, ``--repeats``
rounds, and the table gives medians and the MoE / dense ratio.

    PYTHONPATH=. .venv/bin/python bench/bench_moe.py --dtype bfloat16
    PYTHONPATH=. .venv/bin/python bench/bench_moe.py --quantization int4 --dtype float32

``--serve`` runs the load tests instead, through the servers: ``kvserve serve`` on each
model and, given ``--llama-server BINARY --gguf FILE`` (the MoE converted with llama.cpp's
``convert_hf_to_gguf.py``), llama.cpp's server on the MoE; one at a time, ``--rounds``
rounds in rotation; ``kvserve-loadtest`` with one conversation and with 32.

    PYTHONPATH=. .venv/bin/python bench/bench_moe.py --serve --dtype bfloat16 \
        --llama-server /tmp/llama-server/bin/llama-server --gguf /tmp/moe-bf16.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.bench_engine import make_prompts, run_kvserve
from bench.bench_hybrid_kv import cpu_description, wait_healthy
from engine.builder import build_engine, find_embedded_model
from engine.config import EngineArgs

ROOT = Path(__file__).resolve().parent.parent


def make_models(args: argparse.Namespace) -> dict[str, Path]:
    """The MoE and its dense twin, saved once (bf16 safetensors + SmolLM2's tokenizer)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    gguf = find_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    shared = {
        "vocab_size": len(tokenizer),
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 64 // 3),
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
    }
    configs = {
        "moe": Qwen3MoeConfig(
            **shared,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.expert_width,
            intermediate_size=args.top_k * args.expert_width,
            norm_topk_prob=True,
        ),
        "dense": Qwen3Config(**shared, intermediate_size=args.top_k * args.expert_width),
    }
    classes = {"moe": Qwen3MoeForCausalLM, "dense": Qwen3ForCausalLM}
    paths = {}
    for name, config in configs.items():
        path = args.model_dir / f"{name}-{args.experts}x{args.expert_width}-top{args.top_k}"
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            model = classes[name](config).to(torch.bfloat16)
            with torch.no_grad():  # spread the router's logits as a trained one's are
                for parameter in model.parameters():
                    parameter.mul_(4.0 if parameter.dim() > 1 else 1.0)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


def measure(paths: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    engines = {
        name: build_engine(
            EngineArgs(
                model=str(path),
                device="cpu",
                dtype=args.dtype,
                quantization=args.quantization,
                max_model_len=args.prompt_len + args.output_len + 16,
                kv_cache_memory_gib=0.5,
                swap_space_gib=0,
                max_num_seqs=max(args.batches),
            )
        )
        for name, path in paths.items()
    }
    rows: dict[str, dict[int, list[float]]] = {n: {b: [] for b in args.batches} for n in engines}
    vocab = engines["dense"].core.runner.model.spec.vocab_size  # type: ignore[attr-defined]
    for _ in range(args.repeats):
        for batch in args.batches:
            prompts = make_prompts(batch, args.prompt_len, vocab)
            for name, built in engines.items():
                result = run_kvserve(built.core, prompts, args.output_len, name)
                rows[name][batch].append(result.decode_s / (args.output_len - 1))
    weights = {n: b.weight_bytes for n, b in engines.items()}
    return {"seconds_per_step": rows, "weight_bytes": weights}


def format_table(summary: dict[str, Any]) -> str:
    steps = summary["seconds_per_step"]
    lines = [
        f"CPU: {summary['cpu']}",
        f"weights: MoE {summary['weight_bytes']['moe']:,} B, dense "
        f"{summary['weight_bytes']['dense']:,} B",
        "",
        "| batch | dense ms / step | MoE ms / step | MoE / dense |",
        "|---:|---:|---:|---:|",
    ]
    for batch in steps["dense"]:
        dense = statistics.median(steps["dense"][batch]) * 1e3
        moe = statistics.median(steps["moe"][batch]) * 1e3
        lines.append(f"| {batch} | {dense:.2f} | {moe:.2f} | {moe / dense:.2f}x |")
    return "\n".join(lines)


def server_commands(
    args: argparse.Namespace, paths: dict[str, Path], port: int
) -> dict[str, list[str]]:
    """The command line of every server the load tests compare."""
    kvserve = [
        sys.executable, "-m", "server.cli", "serve", "--port", str(port),
        "--dtype", args.dtype, "--quantization", args.quantization,
        "--max-model-len", "4096", "--kv-cache-memory", "1", "--swap-space", "0",
        "--max-num-seqs", "32",
    ]  # fmt: skip
    commands = {
        f"kvserve {name}": [*kvserve, "--model", str(path), "--served-model-name", name]
        for name, path in paths.items()
    }
    if args.llama_server and args.gguf:
        commands["llama-server moe"] = [
            args.llama_server, "--model", str(args.gguf), "--port", str(port),
            "--host", "127.0.0.1", "-np", "32", "-c", str(32 * 2048), "-t", str(args.threads),
            "--jinja", "--alias", "moe",
        ]  # fmt: skip
    return commands


def load_run(
    url: str, concurrency: int, out: Path, turns: int | None = None, model: str | None = None
) -> dict[str, Any]:
    """One kvserve-loadtest run (``turns`` default: 4 for one conversation, else 2;
    ``model``: its --model); the summary of its JSON."""
    turns = turns or (4 if concurrency == 1 else 2)
    command = [
        sys.executable, "-m", "loadtest", "--url", url, "-c", str(concurrency), "-t", str(turns),
        "--user-len", "64", "--max-tokens", "64", "--ignore-eos", "--no-progress",
        "--request-timeout", "1200", "--json", str(out), *(["--model", model] if model else []),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["summary"]
    return {
        "itl_p50_s": summary["latency_s"]["itl"]["p50"],
        "tpot_p50_s": summary["latency_s"]["tpot"]["p50"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": summary["latency_s"]["ttft"]["p50"],
        "completed": summary["requests"]["completed"],
    }


def serve_and_load(args: argparse.Namespace, paths: dict[str, Path]) -> dict[str, Any]:
    port = 8741
    url = f"http://127.0.0.1:{port}"
    out = args.out or Path("bench/results/moe")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    commands = server_commands(args, paths, port)
    names = list(commands)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            log = (out / f"serve-{name.replace(' ', '-')}.log").open("a")
            server = subprocess.Popen(
                commands[name], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
            )
            try:
                wait_healthy(url, server)
                for concurrency in (1, 32):
                    tag = f"{name.replace(' ', '-')}-c{concurrency}-r{round_index}"
                    row = load_run(url, concurrency, out / f"loadtest-{tag}.json")
                    results.setdefault(name, {}).setdefault(str(concurrency), []).append(row)
            finally:
                server.terminate()
                server.wait(60)
                log.close()
    return {"load": results}


def format_load(summary: dict[str, Any]) -> str:
    lines = [
        f"CPU: {summary['cpu']}",
        "",
        "| server | 1 conversation: ITL p50 | 32 conversations: TPOT p50 | 32: output tok/s |",
        "|---|---:|---:|---:|",
    ]
    for name, by_c in summary["load"].items():
        single = statistics.median(r["itl_p50_s"] for r in by_c["1"]) * 1e3
        tpot = statistics.median(r["tpot_p50_s"] for r in by_c["32"]) * 1e3
        rate = statistics.median(r["output_tokens_per_s"] for r in by_c["32"])
        lines.append(f"| {name} | {single:.2f} ms | {tpot:.1f} ms | {rate:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("build/moe-bench"))
    parser.add_argument("--out", type=Path, default=None, help="write summary.json here")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="load tests through the servers")
    parser.add_argument("--rounds", type=int, default=1, help="--serve: rounds in rotation")
    parser.add_argument("--llama-server", default=None, help="--serve: llama-server binary")
    parser.add_argument("--gguf", type=Path, default=None, help="--serve: the MoE as a GGUF")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    paths = make_models(args)
    summary = {"cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()}}
    summary |= serve_and_load(args, paths) if args.serve else measure(paths, args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(format_load(summary) if args.serve else format_table(summary))


if __name__ == "__main__":
    main()
