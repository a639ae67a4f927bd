"""The hybrid KV cache against an all-full one, on a Gemma-3-shaped model.

A tiny random Gemma 3 text model (12 layers: five sliding-window layers of ``--window``
tokens to one global, SmolLM2's tokenizer) is saved once, then served twice at the same
``--kv-cache-memory``: with its KV groups and with ``--disable-hybrid-kv-cache-manager``.

1. Capacity: how many sequences of ``--context`` tokens the built engine's block manager
   holds at once (prompts in ``--max-num-batched-tokens`` chunks, then a decode step, as
   the scheduler grows them), against ``kvserve plan``'s prediction; and the KV pool's
   resident bytes (the runner's measurement) against the plan's.
2. Load: ``kvserve-loadtest`` with ``--concurrency`` conversations whose histories grow to
   about ``--context`` tokens, through ``kvserve serve`` each way: throughput, TTFT and
   the server's preemptions.

    PYTHONPATH=. .venv/bin/python bench/bench_hybrid_kv.py --out bench/results/hybrid-kv

Prints a Markdown table and writes ``summary.json`` (and the loadtest JSONs) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.kv.accounting import blocks_per_sequence
from engine.request import Request, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def make_model(path: Path, window: int, context: int) -> Path:
    """A random Gemma-3-shaped text model with SmolLM2's tokenizer, saved once."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from engine.builder import find_embedded_model

    gguf = find_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=window,
        max_position_embeddings=2 * context,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def engine_args(model: Path, args: argparse.Namespace, hybrid: bool) -> EngineArgs:
    return EngineArgs(
        model=str(model),
        device="cpu",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        max_model_len=args.context + 1024,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        swap_space_gib=0,
        disable_hybrid_kv_cache_manager=not hybrid,
    )


def measure_capacity(model: Path, args: argparse.Namespace, hybrid: bool) -> dict[str, Any]:
    """Sequences of ``--context`` tokens the built block manager holds at once, grown as
    the scheduler grows them, and the pool's resident bytes against the plan."""
    built = build_engine(engine_args(model, args, hybrid))
    kv = built.core.scheduler.kv
    chunk = args.max_num_batched_tokens
    params = SamplingParams(max_tokens=1)
    held = 0
    while True:
        prompt = [(held * 7919 + i) % 30000 + 100 for i in range(args.context)]
        request = Request(f"s{held}", prompt, params)
        if not _grow(kv, request, chunk):
            kv.free(request)
            break
        held += 1
    pool = built.core.runner.device_pool  # type: ignore[attr-defined]
    measured = built.core.runner.measured_memory().get("kv_cache", pool.nbytes)  # type: ignore[attr-defined]
    plan = built.plan
    return {
        "hybrid": hybrid,
        "groups": [g.label for g in built.kv_shape.groups],
        "num_blocks": plan.num_blocks,
        "bytes_per_block": plan.bytes_per_block,
        "blocks_per_seq": plan.blocks_per_max_len_seq,
        "predicted_seqs": plan.num_blocks // _blocks_at(built, args.context),
        "measured_seqs": held,
        "plan_pool_bytes": plan.kv_pool_bytes,
        "measured_pool_bytes": int(measured),
        "bytes_per_seq": _blocks_at(built, args.context) * plan.bytes_per_block,
    }


def _blocks_at(built: Any, tokens: int) -> int:
    return blocks_per_sequence(built.kv_shape, tokens, built.plan.block_size)


def _grow(kv: Any, request: Request, chunk: int) -> bool:
    """Allocate ``request``'s prompt a chunk at a time (each chunk computed before the
    next, so sliding groups release behind it), then one decode token."""
    while request.num_computed_tokens < request.num_prompt_tokens:
        step = min(chunk, request.num_prompt_tokens - request.num_computed_tokens)
        if kv.allocate_slots(request, step) is None:
            return False
        request.num_computed_tokens += step
        kv.cache_computed_blocks(request)
    request.append_output_token(1)
    return kv.allocate_slots(request, 1) is not None


def run_load(model: Path, args: argparse.Namespace, hybrid: bool, out: Path) -> dict[str, Any]:
    """``kvserve serve`` and ``kvserve-loadtest`` against it; the loadtest's summary."""
    port = 8731 if hybrid else 8732
    serve = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model),
        "--port", str(port), "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16",
        "--max-model-len", str(args.context + 1024),
        "--kv-cache-memory", str(args.kv_cache_memory), "--swap-space", "0",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.concurrency),
    ]  # fmt: skip
    if not hybrid:
        serve.append("--disable-hybrid-kv-cache-manager")
    log = (out / f"serve-{'hybrid' if hybrid else 'full'}.log").open("w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        result = out / f"loadtest-{'hybrid' if hybrid else 'full'}.json"
        load = [
            sys.executable, "-m", "loadtest", "--url", f"http://127.0.0.1:{port}",
            "-c", str(args.concurrency), "-t", str(args.turns),
            "--system-prompt-len", str(args.system_words), "--user-len", str(args.user_words),
            "--max-tokens", str(args.max_tokens), "--ignore-eos", "--no-progress",
            "--request-timeout", "3600", "--json", str(result),
        ]  # fmt: skip
        subprocess.run(load, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(result.read_text())
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def wait_healthy(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("kvserve serve exited; see its log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("kvserve serve did not become healthy")


def cpu_description() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16") if f in text]
    name = model.group(1) if model else platform.processor()
    return f"{name}, {os.cpu_count()} CPUs, flags: {' '.join(flags) or 'AVX2 only'}"


def load_row(document: dict[str, Any]) -> dict[str, Any]:
    summary = document["summary"]
    increase = document["server_metrics"]["increase"]
    samples = document["timeseries"]["server_metrics"]
    busy = [s for s in samples if s.get("num_running", 0) > 0]
    return {
        "peak_kv_usage": max((s.get("kv_usage_ratio", 0.0) for s in samples), default=0.0),
        "max_waiting": max((s.get("num_waiting", 0.0) for s in samples), default=0.0),
        "mean_running": sum(s["num_running"] for s in busy) / max(1, len(busy)),
        "cached_fraction": summary["tokens"]["cached_fraction"],
        "requests_ok": summary["requests"]["completed"],
        "requests_failed": summary["requests"]["failed"],
        "prompt_tokens": summary["tokens"]["prompt"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "total_tokens_per_s": summary["throughput"]["total_tokens_per_s"],
        "ttft_p50_s": summary["latency_s"]["ttft"]["p50"],
        "ttft_p95_s": summary["latency_s"]["ttft"]["p95"],
        "itl_p50_s": summary["latency_s"]["itl"]["p50"],
        "preemptions": increase.get("preemptions_total", 0),
        "duration_s": summary.get("duration_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/hybrid-kv"))
    parser.add_argument("--model-dir", type=Path, default=Path("build/gemma3-shaped"))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB, both runs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=4000)
    parser.add_argument("--user-words", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-load", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_model(args.model_dir, args.window, args.context)
    paths = {"out": str(args.out), "model_dir": str(args.model_dir)}
    summary: dict[str, Any] = {"cpu": cpu_description(), "args": vars(args) | paths}
    summary["capacity"] = [measure_capacity(model, args, hybrid) for hybrid in (True, False)]
    if not args.skip_load:
        summary["load"] = [
            load_row(run_load(model, args, hybrid, args.out)) | {"hybrid": hybrid}
            for hybrid in (True, False)
        ]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(format_table(summary))


def format_table(summary: dict[str, Any]) -> str:
    hybrid, full = summary["capacity"]
    measured_gain = hybrid["measured_seqs"] / max(1, full["measured_seqs"])
    predicted_gain = full["bytes_per_seq"] / hybrid["bytes_per_seq"]
    lines = [
        f"CPU: {summary['cpu']}",
        "",
        "| cache | blocks | sequences predicted | sequences held | pool bytes plan | measured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in (hybrid, full):
        lines.append(
            f"| {'hybrid' if row['hybrid'] else 'all-full'} | {row['num_blocks']} | "
            f"{row['predicted_seqs']} | {row['measured_seqs']} | {row['plan_pool_bytes']:,} | "
            f"{row['measured_pool_bytes']:,} |"
        )
    lines += [
        "",
        f"capacity gain: predicted {predicted_gain:.3f}x (bytes per "
        f"{summary['args']['context']}-token sequence), measured {measured_gain:.3f}x "
        f"({measured_gain / predicted_gain - 1:+.1%})",
    ]
    for row in summary.get("load", []):
        lines.append(
            f"{'hybrid' if row['hybrid'] else 'all-full'}: {row['output_tokens_per_s']:.1f} "
            f"output tok/s ({row['total_tokens_per_s']:.0f} total), TTFT p50 "
            f"{row['ttft_p50_s']:.2f} s p95 {row['ttft_p95_s']:.2f} s, ITL p50 "
            f"{row['itl_p50_s'] * 1000:.0f} ms, preemptions {row['preemptions']:.0f}, "
            f"{row['requests_ok']} requests ok, {row['requests_failed']} failed, "
            f"{row['duration_s']:.0f} s; running {row['mean_running']:.1f} on average, up to "
            f"{row['max_waiting']:.0f} waiting, peak KV use {row['peak_kv_usage']:.0%}, "
            f"prompt tokens from the prefix cache {row['cached_fraction']:.0%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
