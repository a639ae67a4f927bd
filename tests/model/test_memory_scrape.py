"""Measuring memory (what /metrics does on the event loop) must not start an OpenMP team
on the scraping thread: with more OpenMP workers than CPUs libgomp stops spin-waiting in
every team, and the engine's decode steps got ~40% slower for good after one scrape."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import threading, torch
    from engine.model.runtime.memory import resident_bytes

    torch.set_num_threads(2)
    torch.ones(1 << 22).sum()  # the main thread's team, as the engine thread has one

    def threads():
        status = open("/proc/self/status").read().splitlines()
        return int(next(l for l in status if l.startswith("Threads:")).split()[1])

    # 64k pages: past torch's parallel grain (32k elements), as a real KV pool is.
    pool = [torch.zeros(256 << 20, dtype=torch.uint8)]
    seen = {}

    def idle():
        seen["idle"] = threads()

    def scrape():
        assert resident_bytes(pool) is not None
        seen["scrape"] = threads()

    def parallel_torch_op():  # the control: this does start a team
        torch.ones(1 << 22).sum()
        seen["torch"] = threads()

    for fn in (idle, scrape, parallel_torch_op):
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()
    print(seen["idle"], seen["scrape"], seen["torch"])
    """
)


def test_resident_bytes_starts_no_openmp_team_on_the_calling_thread():
    # A fresh interpreter: OpenMP teams already started by other tests would hide it.
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    idle, scrape, torch_op = map(int, result.stdout.split())
    assert torch_op > idle, "the probe cannot see a new OpenMP team on this machine"
    assert scrape == idle
