"""Batch-1 decode step time by the thread that runs it, the same engine throughout.

Shows why the server builds the engine on the thread that steps it
(engine/compute_thread.py): the engine is built on the main thread, then one 128-token
greedy request is decoded on the main thread, on a second thread, and on the main
thread again; each line is the median ``EngineCore.step`` time of one request.

    .venv/bin/python bench/bench_engine_thread.py --quantization int8
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams


def median_step_ms(core: EngineCore, request_id: str) -> float:
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    core.add_request([Request(request_id, list(range(100, 140)), params)])
    times = []
    while core.has_unfinished():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def on_other_thread(core: EngineCore, request_id: str) -> float:
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(median_step_ms(core, request_id)))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    core = build_engine(EngineArgs(quantization=args.quantization)).core
    for repeat in range(args.repeats):
        main_ms = median_step_ms(core, f"main-{repeat}")
        other_ms = on_other_thread(core, f"other-{repeat}")
        again_ms = median_step_ms(core, f"again-{repeat}")
        print(
            f"{args.quantization}: main thread {main_ms:.1f} ms, second thread {other_ms:.1f} ms "
            f"({other_ms / main_ms:.2f}x), main thread again {again_ms:.1f} ms"
        )


if __name__ == "__main__":
    main()
