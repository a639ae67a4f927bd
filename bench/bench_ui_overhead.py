"""Output throughput of the 32-conversation load test with the /ui page open vs closed.

Starts ``kvserve serve`` (the embedded SmolLM2 unless --model), opens one headless
Chromium (Debian's, through Selenium), then runs the load test (``python -m loadtest``)
in alternating phases -- page closed, page open, page open, page closed, ... (ABBA, so
neither state always runs second) -- each phase with its own prompts (seed), and reports
the median output tok/s of each state. In the first open phase it saves a screenshot of
the page under load.

    python bench/bench_ui_overhead.py --repeats 2 --duration 50 --out bench/results/ui \
        --screenshot docs/ui-block-map.png --server-arg=--kv-cache-host-size=0.05

Every conversation opens with the same system prompt (``--system-prompt-len`` words), so
its blocks are shared on the map; a host tier makes the tier pools appear too.

``--url`` measures an already running server instead of starting one; ``--duration``
bounds each phase (the load test's own --duration, with a 5 s drain) so that a slow
machine still gets several phases.
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

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    port: int, model: str | None, extra: list[str], log: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port)]
    cmd += ["--max-num-seqs", "32", "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not become healthy")


def open_browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1500"):
        options.add_argument(arg)
    options.add_argument("--disable-dev-shm-usage")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def run_phase(url: str, args: argparse.Namespace, seed: int, out: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "loadtest", "--url", url, "-c", str(args.concurrency)]
    cmd += ["-t", str(args.turns), "--max-tokens", str(args.max_tokens), "--ignore-eos"]
    cmd += ["--seed", str(seed), "--json", str(out / f"phase-{seed}.json")]
    cmd += ["--png", str(out / f"phase-{seed}.png"), "--no-progress"]
    cmd += ["--system-prompt-len", str(args.system_prompt_len)]
    if args.duration:
        cmd += ["--duration", str(args.duration), "--drain-timeout", "5"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def screenshot_when_busy(driver: Any, path: Path, stop: threading.Event) -> None:
    """Wait until the page shows a busy pool, then save the screenshot."""
    while not stop.is_set():
        running = driver.execute_script(
            "const d = document.getElementById('requests').dataset;"
            "return Number(d.running || 0) + Number(d.waiting || 0);"
        )
        if running >= 16:
            time.sleep(1.0)  # let the next snapshot land
            path.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(path))
            return
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=2, help="ABBA pairs of phases")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--system-prompt-len",
        type=int,
        default=60,
        help="words of a system prompt every conversation shares (its blocks are shared)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an extra kvserve serve argument (repeatable): --server-arg=--kv-cache-host-size=1",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/ui"))
    parser.add_argument("--screenshot", type=Path, default=None)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per phase")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if args.url:
        url = args.url
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(port, args.model, args.server_arg, args.out / "server.log")
    driver = open_browser()
    results: list[dict[str, Any]] = []
    shot_taken = args.screenshot is None
    try:
        states = []
        for pair in range(args.repeats):
            states += (
                ["closed", "open", "open", "closed"]
                if pair % 2 == 0
                else ["open", "closed", "closed", "open"]
            )
        for seed, state in enumerate(states, start=100):
            driver.get(f"{url}/ui" if state == "open" else "about:blank")
            stop = threading.Event()
            shooter = None
            if state == "open" and not shot_taken:
                shooter = threading.Thread(
                    target=screenshot_when_busy, args=(driver, args.screenshot, stop)
                )
                shooter.start()
                shot_taken = True
            phase = run_phase(url, args, seed, args.out)
            phase.wait()
            stop.set()
            if shooter is not None:
                shooter.join()
            document = json.loads((args.out / f"phase-{seed}.json").read_text())
            tps = document["summary"]["throughput"]["output_tokens_per_s"]
            load = os.getloadavg()[0]
            results.append({"phase": seed, "page": state, "output_tok_s": tps, "load1": load})
            print(f"phase {seed} page {state:6s} {tps:7.1f} out tok/s  load {load:.1f}", flush=True)
    finally:
        driver.quit()
        if server is not None:
            server.terminate()
            server.wait(60)
    medians = {
        s: statistics.median(r["output_tok_s"] for r in results if r["page"] == s)
        for s in ("closed", "open")
    }
    ratio = medians["open"] / medians["closed"]
    summary = {"phases": results, "median_output_tok_s": medians, "open_over_closed": ratio}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"median out tok/s: closed {medians['closed']:.1f}, open {medians['open']:.1f} "
        f"(open/closed {ratio:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
