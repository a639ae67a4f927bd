"""No request stalls the event loop (issue 42): while four ~4 MB bodies are parsed,
tokenized and answered, ``/health`` and a running stream keep answering within 100 ms.

The bodies are the issue's: a completions prompt, a chat message and a /tokenize prompt
of 3.9 MB of text each, plus a completions prompt of ~3.9 MB of token ids (the costliest
to parse and validate).

What is measured is the server, not this machine's other tenants or this process:

- the server is the real ``kvserve serve``, in its own process;
- the probe (``/health`` every 20 ms) and the stream run in a third process of their own
  (tests/server/loop_probe.py), which imports no torch: in this process a garbage
  collection over torch's objects once read as a 600 ms pause of the server;
- the server runs with ``OMP_NUM_THREADS=1``: the tiny model needs no parallelism, and
  on a shared 2-core machine an OpenMP region waits for whichever of its threads another
  tenant descheduled (stream gaps of 170 ms before any body was sent);
- the server and the probe run at ``nice -5`` where that is allowed (else as they are),
  and the test is skipped, saying so, when the machine's 1-minute load average is above
  ``MAX_LOAD_PER_CORE`` per core: with other tenants keeping 9-10 threads runnable on 2
  cores the server's process waited for a core ~300 ms at a time, before any of its own
  work (docs/reference/reliability.md, "Event loop").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import kvserve_process

pytestmark = pytest.mark.slow

LATENCY_BOUND_S = 0.100  # the bound
MAX_LOAD_PER_CORE = 2.0
BASELINE_S = 3.0  # probed and streamed before the bodies, for the report
BODY_CHARS = 3_900_000
SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps running. "
ROOT = Path(__file__).resolve().parents[2]


def large_bodies() -> list[tuple[str, bytes]]:
    """(path, body) of the four ~4 MB requests."""
    text = (SENTENCE * (BODY_CHARS // len(SENTENCE) + 1))[:BODY_CHARS]
    ids = [1000 + i % 9000 for i in range(BODY_CHARS // 6)]  # "1234, " = 6 bytes an id
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/tokenize", {"prompt": text}),
        ("/v1/completions", {"prompt": ids, "max_tokens": 1}),
    ]
    return [(path, json.dumps(body).encode()) for path, body in bodies]


def large_agent_bodies() -> list[tuple[str, bytes]]:
    """(path, body) of four ~4 MB requests to the agent APIs: one long text each, and
    ~100k short items or messages each (translated and validated item by item)."""
    text = (SENTENCE * (BODY_CHARS // len(SENTENCE) + 1))[:BODY_CHARS]
    item = {"role": "user", "content": "hi"}
    items = [item] * (BODY_CHARS // len(json.dumps(item)))
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/responses", {"input": text, "max_output_tokens": 1}),
        ("/v1/responses", {"input": items, "max_output_tokens": 1}),
        ("/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        ("/v1/messages", {"messages": items, "max_tokens": 1}),
    ]
    return [(path, json.dumps(body).encode()) for path, body in bodies]


def post_raw(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=300) as client:
        resp = client.post(f"{url}{path}", content=body, headers=headers)
        return resp.status_code, resp.content


def send_all(url: str, bodies: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    """All bodies at once, one thread each; their answers in order."""
    results: list[tuple[int, bytes]] = [(0, b"")] * len(bodies)

    def send(i: int) -> None:
        results[i] = post_raw(url, *bodies[i])

    senders = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(300)
    return results


def worst(samples: list[list[float]], start: float, end: float) -> tuple[int, float]:
    """(how many, the largest value) of the samples taken within [start, end]."""
    window = [value for at, value in samples if start <= at <= end]
    return len(window), max(window, default=0.0)


def skip_when_overloaded() -> None:
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    if load > MAX_LOAD_PER_CORE * cores:
        pytest.skip(
            f"load average {load:.1f} on {cores} cores: other tenants, not this server, "
            "would decide the latencies (see the module docstring)"
        )


def test_health_and_streams_answer_within_100ms_under_four_4mb_bodies(tiny_model_dir: Path):
    results = probe_under(tiny_model_dir, large_bodies())
    assert [status for status, _ in results] == [400, 400, 200, 400], [r[:200] for _, r in results]
    assert b'"count":' in results[2][1]


def test_the_agent_apis_keep_the_loop_free_under_four_4mb_bodies(tiny_model_dir: Path):
    results = probe_under(tiny_model_dir, large_agent_bodies())
    # Each is refused (past the context, or past --max-messages), never a 5xx.
    assert [status for status, _ in results] == [400] * 4, [r[:200] for _, r in results]


def probe_under(tiny_model_dir: Path, bodies: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    """Send ``bodies`` at once to a real server while a probe process times /health and a
    running stream; assert both stayed within the bound; the bodies' answers."""
    skip_when_overloaded()
    assert all(3_800_000 < len(body) < 4 * 1024 * 1024 for _, body in bodies)
    flags = ("--num-kv-blocks", "512", "--kernels", "torch")
    nice = ("nice", "-n", "-5")
    with kvserve_process(
        tiny_model_dir, *flags, env={"OMP_NUM_THREADS": "1"}, prefix=nice
    ) as server:
        probe = subprocess.Popen(
            [*nice, sys.executable, "-m", "tests.server.loop_probe", server.url],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert probe.stdout is not None and probe.stdin is not None
        assert probe.stdout.readline().strip() == "streaming"
        quiet = time.monotonic()
        time.sleep(BASELINE_S)
        start = time.monotonic()
        results = send_all(server.url, bodies)
        end = time.monotonic()
        out, _ = probe.communicate("stop\n", timeout=120)
        assert probe.returncode == 0
    timeline = json.loads(out.strip().splitlines()[-1])
    _, quiet_probe = worst(timeline["probes"], quiet, start)
    _, quiet_gap = worst(timeline["gaps"], quiet, start)
    probes, worst_probe = worst(timeline["probes"], start, end)
    chunks, worst_gap = worst(timeline["gaps"], start, end)
    print(
        f"\nload average {os.getloadavg()[0]:.1f}; before the bodies ({BASELINE_S:g} s): "
        f"worst /health {quiet_probe * 1000:.0f} ms, "
        f"worst stream gap {quiet_gap * 1000:.0f} ms\nfour ~4 MB bodies answered in "
        f"{end - start:.1f} s; /health probes: {probes}, worst latency "
        f"{worst_probe * 1000:.0f} ms; stream chunks: {chunks}, worst gap {worst_gap * 1000:.0f} ms"
    )
    assert probes > 50 and chunks > 50
    assert worst_probe < LATENCY_BOUND_S
    assert worst_gap < LATENCY_BOUND_S
    return results
