"""Measured vs predicted memory of a kvserve server under the 32-conversation load test.

Starts `kvserve serve` (defaults, as `compare_servers.py --servers kvserve`, plus any
extra flags), runs `python -m loadtest` against it and scrapes /metrics every
--scrape-interval seconds meanwhile, then writes every scrape and a summary:

- KV pool: kvserve_device_memory_measured_bytes{component="kv_cache"} (resident pages,
  CPU) / kvserve_device_memory_bytes{component="kv_cache"} (computed);
- process: process_resident_memory_bytes / sum(kvserve_device_memory_bytes) (weights +
  KV pool + activation reserve + copy staging, the plan's prediction); the host offload
  pool is added to the prediction when there is one.

    .venv/bin/python bench/memory_ratio.py --out bench/results/memory --duration 90 \\
        --serve-flag=--kv-cache-memory=0.5 --serve-flag=--swap-space=0.25 \\
        -- -c 32 -t 4 --max-tokens 48 --user-len 48 --drain-timeout 15
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(url: str) -> dict[str, float]:
    """The memory series of one scrape, keyed 'name' or 'name{component}'."""
    body = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if "memory" in sample.name or sample.name.startswith("process_"):
                component = sample.labels.get("component")
                key = f"{sample.name}{{{component}}}" if component else sample.name
                out[key] = sample.value
    return out


def ratios(sample: dict[str, float]) -> dict[str, float]:
    computed = "kvserve_device_memory_bytes"
    predicted = sum(v for k, v in sample.items() if k.startswith(computed + "{"))
    predicted += sample.get("kvserve_host_kv_cache_memory_bytes", 0.0)
    out = {"process_rss_over_predicted": sample["process_resident_memory_bytes"] / predicted}
    measured_kv = sample.get("kvserve_device_memory_measured_bytes{kv_cache}")
    if measured_kv is not None:
        out["kv_pool_measured_over_computed"] = measured_kv / sample[computed + "{kv_cache}"]
    return out


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("kvserve exited before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("kvserve was not ready in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--scrape-interval", type=float, default=2.0)
    parser.add_argument("--ready-timeout", type=float, default=1800, help="seconds to start")
    parser.add_argument("--serve-flag", action="append", default=[], help="extra serve flag")
    parser.add_argument("loadtest_args", nargs="*", help="after --: flags for loadtest")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1"]
    serve += ["--port", str(port), "--log-level", "warning", *args.serve_flag]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (args.out / "serve.log").open("wb") as log:
        server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    scrapes: list[dict[str, Any]] = []
    try:
        wait_ready(url, server, args.ready_timeout)
        stop = threading.Event()

        def scrape_loop() -> None:
            while not stop.is_set():
                try:
                    scrapes.append({"t": time.time(), **scrape(url)})
                except httpx.HTTPError as error:
                    print(f"scrape failed: {error!r}", file=sys.stderr)
                stop.wait(args.scrape_interval)

        scraper = threading.Thread(target=scrape_loop, daemon=True)
        scraper.start()
        loadtest = [sys.executable, "-m", "loadtest", "--url", url, "--no-progress"]
        loadtest += ["--duration", str(args.duration), "--json", str(args.out / "loadtest.json")]
        loadtest += ["--png", str(args.out / "loadtest.png"), *args.loadtest_args]
        subprocess.run(loadtest, cwd=ROOT, env=env, check=False)
        stop.set()
        scraper.join(60)
        scrapes.append({"t": time.time(), **scrape(url)})
    finally:
        server.terminate()
        server.wait(60)
    summarise(scrapes, args, serve)


def summarise(scrapes: list[dict[str, Any]], args: argparse.Namespace, serve: list[str]) -> None:
    per_scrape = [ratios(s) for s in scrapes]
    summary: dict[str, Any] = {"serve": serve[1:], "loadtest_args": args.loadtest_args}
    summary["duration_s"] = args.duration
    summary["scrapes"] = len(scrapes)
    for key in per_scrape[0]:
        series = [r[key] for r in per_scrape]
        summary[key] = {
            "min": min(series),
            "median": statistics.median(series),
            "max": max(series),
            "last": series[-1],
        }
    last = scrapes[-1]
    summary["last_scrape"] = {k: v for k, v in last.items() if k != "t"}
    (args.out / "scrapes.json").write_text(json.dumps(scrapes, indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
