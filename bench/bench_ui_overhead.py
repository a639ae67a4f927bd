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


def run_phase(
    url: str, args: argparse.Namespace, seed: int, out: Path, name: str
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "loadtest", "--url", url, "-c", str(args.concurrency)]
    cmd += ["-t", str(args.turns), "--max-tokens", str(args.max_tokens), "--ignore-eos"]
    cmd += ["--seed", str(seed), "--json", str(out / f"phase-{name}.json")]
    cmd += ["--png", str(out / f"phase-{name}.png"), "--no-progress"]
    cmd += ["--system-prompt-len", str(args.system_prompt_len)]
    if args.duration:
        cmd += ["--duration", str(args.duration), "--drain-timeout", "5"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def screenshot_when_busy(
    driver: Any, path: Path, stop: threading.Event, after_s: float = 20.0
) -> None:
    """Wait ``after_s`` (so the prefix cache, and any tier, fill) until the page shows a
    busy pool, then save the screenshot."""
    stop.wait(after_s)
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


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process (all its threads) so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return seconds


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two readings; processes started in between count whole (the
    browser starts renderers per page). Processes that ended in between are lost."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (the browser's renderer, GPU, ... processes)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


class StreamViewer:
    """The page's server-side cost without a browser: reads /ui/api/stream like the page."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.snapshots = 0

    def open(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _read(self) -> None:
        with httpx.stream("GET", f"{self.url}/ui/api/stream", timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("event: snapshot"):
                    self.snapshots += 1
                if self._stop.is_set():
                    return


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
    parser.add_argument(
        "--viewer",
        choices=("browser", "stream"),
        default="browser",
        help="browser: headless Chromium renders the page (on this machine's cores); "
        "stream: read /ui/api/stream only, the server's side of an open page",
    )
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument(
        "--same-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every phase sends the same conversations (after an unmeasured warm-up phase)",
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
    driver = open_browser() if args.viewer == "browser" else None
    viewer = StreamViewer(url) if args.viewer == "stream" else None
    results: list[dict[str, Any]] = []
    shot_taken = args.screenshot is None or driver is None
    try:
        states = []
        for pair in range(args.repeats):
            states += (
                ["closed", "open", "open", "closed"]
                if pair % 2 == 0
                else ["open", "closed", "closed", "open"]
            )
        if args.same_prompts:
            # Every phase sends the same conversations, so phases differ only in the page;
            # an unmeasured first phase fills the prefix cache they all then hit alike.
            run_phase(url, args, args.seed, args.out, name="warmup").wait()
        for index, state in enumerate(states):
            seed = args.seed if args.same_prompts else args.seed + index
            phase_name = str(100 + index)
            if driver is not None:
                driver.get(f"{url}/ui" if state == "open" else "about:blank")
            elif viewer is not None and state == "open":
                viewer.open()
            server_pids = [server.pid] if server is not None else []
            browser_root = driver.service.process.pid if driver is not None else None
            server_before = cpu_seconds(server_pids)
            browser_before = cpu_seconds(descendants(browser_root) if browser_root else [])
            stop = threading.Event()
            shooter = None
            if state == "open" and not shot_taken:
                shooter = threading.Thread(
                    target=screenshot_when_busy, args=(driver, args.screenshot, stop)
                )
                shooter.start()
                shot_taken = True
            phase = run_phase(url, args, seed, args.out, name=phase_name)
            phase.wait()
            stop.set()
            if shooter is not None:
                shooter.join()
            if viewer is not None and state == "open":
                viewer.close()
            server_cpu = cpu_used(server_before, cpu_seconds(server_pids))
            browser_after = cpu_seconds(descendants(browser_root) if browser_root else [])
            browser_cpu = cpu_used(browser_before, browser_after)
            document = json.loads((args.out / f"phase-{phase_name}.json").read_text())
            summary = document["summary"]
            tps = summary["throughput"]["output_tokens_per_s"]
            output = summary["tokens"]["output"]
            load = os.getloadavg()[0]
            results.append(
                {
                    "phase": phase_name,
                    "seed": seed,
                    "page": state,
                    "output_tok_s": tps,
                    "output_tokens": output,
                    "server_cpu_s": server_cpu,
                    "server_cpu_ms_per_token": 1000 * server_cpu / max(1, output),
                    "browser_cpu_s": browser_cpu,
                    "duration_s": summary["duration_s"],
                    "load1": load,
                }
            )
            print(
                f"phase {phase_name} page {state:6s} {tps:7.1f} out tok/s  server "
                f"{1000 * server_cpu / max(1, output):.1f} CPU-ms/token  browser "
                f"{browser_cpu:.1f} CPU-s  load {load:.1f}",
                flush=True,
            )
    finally:
        if driver is not None:
            driver.quit()
        if server is not None:
            server.terminate()
            server.wait(60)
    medians = {
        s: statistics.median(r["output_tok_s"] for r in results if r["page"] == s)
        for s in ("closed", "open")
    }
    cpu_per_token = {
        s: statistics.median(r["server_cpu_ms_per_token"] for r in results if r["page"] == s)
        for s in ("closed", "open")
    }
    ratio = medians["open"] / medians["closed"]
    summary = {
        "viewer": args.viewer,
        "phases": results,
        "median_output_tok_s": medians,
        "open_over_closed": ratio,
        "median_server_cpu_ms_per_token": cpu_per_token,
        "snapshots_read": viewer.snapshots if viewer is not None else None,
    }
    (args.out / f"summary-{args.viewer}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"median out tok/s: closed {medians['closed']:.1f}, open {medians['open']:.1f} "
        f"(open/closed {ratio:.3f}); server CPU-ms per output token: closed "
        f"{cpu_per_token['closed']:.1f}, open {cpu_per_token['open']:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
