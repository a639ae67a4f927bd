"""One long-lived thread for all of the engine's torch work: loading, warm-up and steps.

Why one thread: OpenMP (libgomp, which torch and kvserve's CPU kernels use) keeps a
worker pool per thread that starts parallel regions, and once more workers exist than
CPUs it stops spin-waiting between regions. Building the model on the main thread and
stepping it on another left two pools on a two-core machine, and every kernel call then
waited for sleeping workers to wake: a batch-1 int8 decode step took 40-54 ms instead
of 15 ms (bench/bench_engine_thread.py).
Running the build and the step loop on the same thread keeps a single pool.

The same class runs the engine's side work beside a step (grammar masks filled ahead,
tier copies written ahead); that work calls no OpenMP-parallel torch op for this reason.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple[Callable[[], Any], Future[Any]] | None


class ComputeThread:
    """A daemon thread that runs submitted callables one at a time, in order."""

    def __init__(self, name: str = "kvserve-engine") -> None:
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn``; its result or exception arrives through the returned future."""
        future: Future[T] = Future()
        self._tasks.put((fn, future))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for its result (re-raising its error)."""
        return self.submit(lambda: fn(*args)).result()

    def close(self) -> None:
        """Let the thread exit once the queued callables have run."""
        self._tasks.put(None)

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiter, never lost in the thread
                future.set_exception(exc)
