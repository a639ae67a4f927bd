"""ComputeThread: one thread runs everything it is given, in order, and hands back
results and errors; AsyncEngine steps on the compute thread it is given (the one that
built the engine), so all torch work shares one OpenMP pool."""

from __future__ import annotations

import threading

import pytest

from engine.compute_thread import ComputeThread


def test_calls_run_in_order_on_one_named_thread():
    compute = ComputeThread("kvserve-test")
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    futures = [compute.submit(lambda i=i: record(i)) for i in range(5)]
    assert [f.result(5) for f in futures] == [0, 1, 4, 9, 16]
    assert compute.call(record, 5) == 25
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4, 5]
    assert {name for _, name in seen} == {"kvserve-test"}
    compute.close()


def test_errors_reach_the_caller_and_the_thread_keeps_serving():
    compute = ComputeThread()

    def fail() -> None:
        raise ValueError("bad flag")

    with pytest.raises(ValueError, match="bad flag"):
        compute.call(fail)
    assert compute.call(lambda: 3) == 3
    compute.close()


def test_close_ends_the_thread_after_queued_work():
    compute = ComputeThread("kvserve-closing")
    gate = threading.Event()
    first = compute.submit(lambda: gate.wait(5))
    second = compute.submit(lambda: "ran")
    compute.close()
    gate.set()
    assert first.result(5) is True and second.result(5) == "ran"
    compute._thread.join(5)
    assert not compute._thread.is_alive()
