"""The latency probe of tests/server/test_hardening_event_loop.py, run as its own process.

``python -m tests.server.loop_probe URL`` polls ``URL/health`` every 20 ms and keeps a
greedy chat stream running, back to back, until a line arrives on stdin; then it prints
one JSON object: ``probes`` as ``[sent, latency]`` and ``gaps`` as ``[arrived, gap since
the stream's previous chunk]`` (the first chunk of a stream, its time to first token, is
no gap), times from ``time.monotonic()`` (system-wide, so comparable with the test's).

Its own process, importing nothing but httpx: in the test process the probe would share
a GIL and a garbage collector with torch and the senders, and a pause of the test itself
would read as a pause of the server.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx

PROBE_INTERVAL_S = 0.020
STREAM_BODY = {
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": 900,
    "ignore_eos": True,
    "temperature": 0.0,
    "stream": True,
}


def probe_health(url: str, stop: threading.Event, probes: list[list[float]]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            sent = time.monotonic()
            if client.get(f"{url}/health").status_code != 200:
                raise SystemExit("/health did not answer 200")
            probes.append([sent, time.monotonic() - sent])
            time.sleep(PROBE_INTERVAL_S)


def stream(url: str, stop: threading.Event, gaps: list[list[float]]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            with client.stream("POST", f"{url}/v1/chat/completions", json=STREAM_BODY) as resp:
                if resp.status_code != 200:
                    raise SystemExit(f"the stream answered {resp.status_code}")
                last = None
                for line in resp.iter_lines():
                    if not line:
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append([now, now - last])
                    else:
                        print("streaming", flush=True)
                    last = now
                    if stop.is_set():
                        break


def main(url: str) -> None:
    stop = threading.Event()
    probes: list[list[float]] = []
    gaps: list[list[float]] = []
    workers = [
        threading.Thread(target=probe_health, args=(url, stop, probes), daemon=True),
        threading.Thread(target=stream, args=(url, stop, gaps), daemon=True),
    ]
    for worker in workers:
        worker.start()
    sys.stdin.readline()
    stop.set()
    for worker in workers:
        worker.join(60)
    print(json.dumps({"probes": probes, "gaps": gaps}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
