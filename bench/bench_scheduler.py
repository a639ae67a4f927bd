"""Scheduler step cost: schedule() + update() with N running decode requests.

Pure Python, no model: every request decodes one token per step, and the runner's output
is built outside the timed region, so the figure is the scheduler's own overhead per step
(block growth, prefix-cache registration of filled blocks, stop checks, deltas).

    .venv/bin/python -m bench.bench_scheduler [--requests 256] [--steps 400]

``--waiting 10,100,1000`` adds that many requests that cannot be admitted (the running
ones take every sequence slot) behind the running ones, with a queue timeout checked every step
and a bounded queued-token sum, and reports the per-step cost at each queue length: it
must not grow with the queue.

``--sliding-window W --pattern 5:1`` gives the model KV groups (engine/kv/groups.py): a
Gemma-3-shaped 6-layer stack of 5 sliding-window layers per full one, so every request
holds 6 block tables (5 sliding groups in lock step and the full one). The prompts are
several windows long, so the sliding groups release blocks as the requests decode.
``--against-single`` runs that hybrid stack and the single-group model in alternation,
``--repeats`` rounds each, and prints the ratio of their medians (the hybrid cache's
cost to the scheduler, measured side by side).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv.accounting import KVShape
from engine.kv.groups import plan_kv_groups
from engine.outputs import RunnerOutput
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler

# SmolLM2-135M's attention shape; only used for the byte figures in stats.
SHAPE = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, kv_dtype="bfloat16")


def kv_shape(args: argparse.Namespace) -> KVShape:
    """SmolLM2-135M's shape, or a hybrid stack of ``--pattern`` sliding:full layers."""
    if not args.sliding_window:
        return SHAPE
    sliding, full = (int(n) for n in args.pattern.split(":"))
    windows = [args.sliding_window] * sliding + [None] * full
    return KVShape(len(windows), 3, 64, "bfloat16", plan_kv_groups(windows))


def build_scheduler(args: argparse.Namespace, waiting: int = 0) -> Scheduler:
    max_len = args.prompt_len + args.steps + 16
    blocks_per_seq = -(-max_len // args.block_size)
    cache = CacheConfig(
        num_device_blocks=args.requests * blocks_per_seq + 16,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    config = SchedulerConfig(
        max_model_len=max_len + 1,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.requests * args.prompt_len,
        max_queued_tokens=10**12 if waiting else 0,  # a bound, so add() keeps the sum
    )
    shape = kv_shape(args)
    cache = CacheConfig(
        num_device_blocks=cache.num_device_blocks * len(shape.groups),
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
    )
    scheduler = Scheduler(config, cache, shape)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    for index in range(args.requests):
        prompt = [(index * 7919 + pos) % 32000 for pos in range(args.prompt_len)]
        scheduler.add_request([Request(f"r{index}", prompt, params, eos_token_ids=(2,))])
    return scheduler


def decode_result(out: object) -> RunnerOutput:
    scheduled = out.scheduled  # type: ignore[attr-defined]
    return RunnerOutput(sampled_token_ids={r.request_id: 17 for r in scheduled if r.sample})


def add_waiting(scheduler: Scheduler, args: argparse.Namespace, count: int) -> None:
    """Requests that cannot start while the running ones take every sequence slot: they
    stay queued (and looked at, and checked for expiry) for the whole run."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for index in range(count):
        prompt = [(index * 31 + pos) % 32000 for pos in range(args.prompt_len)]
        scheduler.add_request([Request(f"w{index}", prompt, params, eos_token_ids=(2,))])


def measure(args: argparse.Namespace, clock: Callable[[], float], waiting: int = 0) -> list[float]:
    scheduler = build_scheduler(args, waiting)
    out = scheduler.schedule()  # the whole prefill in one step
    scheduler.update(out, decode_result(out))
    assert len(scheduler.running) == args.requests
    add_waiting(scheduler, args, waiting)
    core = EngineCore(scheduler, runner=None)  # type: ignore[arg-type]  # only for expiry
    samples = []
    for _ in range(args.steps):
        start = clock()
        if waiting:
            core.expire_queued(3600.0)  # none expires; the check itself is timed
        out = scheduler.schedule()
        schedule_done = clock()
        result = decode_result(out)
        resumed = clock()
        scheduler.update(out, result)
        end = clock()
        samples.append((schedule_done - start) + (end - resumed))
        assert len(out.scheduled) == args.requests
    assert len(scheduler.waiting) == waiting
    scheduler.check_integrity()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--sliding-window", type=int, default=0, help="0: one full group")
    parser.add_argument("--pattern", default="5:1", help="sliding:full layers (with a window)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--waiting",
        default="",
        help="comma-separated queue lengths (e.g. 10,100,1000): per-step cost at each",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process CPU clock (robust when other jobs share the cores)",
    )
    parser.add_argument(
        "--against-single",
        action="store_true",
        help="with --sliding-window: alternate the hybrid stack and one full group",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.against_single:
        report_against_single(args, clock)
        return
    if args.waiting:
        report_queue_lengths(args, clock, [int(n) for n in args.waiting.split(",")])
        return
    medians, p99s, means, fastest = [], [], [], []
    for _ in range(args.repeats):
        samples = sorted(measure(args, clock))
        fastest.append(samples[0])
        medians.append(statistics.median(samples))
        p99s.append(samples[int(0.99 * (len(samples) - 1))])
        means.append(statistics.fmean(samples))
    caching = "off" if args.no_prefix_caching else "on"
    groups = kv_shape(args).groups
    print(
        f"groups={len(groups)} ({', '.join(g.label for g in groups)}) "
        f"requests={args.requests} block_size={args.block_size} prefix_caching={caching} "
        f"steps={args.steps} repeats={args.repeats} "
        f"clock={'process_time' if args.cpu_time else 'perf_counter'}"
    )
    print(
        f"schedule+update per step: min {min(fastest) * 1e6:.0f} us, "
        f"median {min(medians) * 1e6:.0f} us, "
        f"mean {min(means) * 1e6:.0f} us, p99 {min(p99s) * 1e6:.0f} us "
        f"({min(medians) * 1e6 / args.requests:.2f} us per request; best of {args.repeats})"
    )


def report_queue_lengths(
    args: argparse.Namespace, clock: Callable[[], float], lengths: list[int]
) -> None:
    """Interleaved repeats (each length once per round), best median per length."""
    medians: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(args.repeats):
        for n in lengths:
            medians[n].append(statistics.median(measure(args, clock, n)))
    print(
        f"running={args.requests} steps={args.steps} repeats={args.repeats} "
        f"clock={'process_time' if args.cpu_time else 'perf_counter'}"
    )
    for n in lengths:
        runs = ", ".join(f"{m * 1e6:.0f}" for m in medians[n])
        print(f"waiting={n:5d}: median step {min(medians[n]) * 1e6:.0f} us (runs: {runs} us)")


def report_against_single(args: argparse.Namespace, clock: Callable[[], float]) -> None:
    """Interleaved rounds of the hybrid stack and the single-group model: each round's
    median step, then the ratio of the medians and of the fastest rounds."""
    if not args.sliding_window:
        raise SystemExit("--against-single compares a hybrid stack: give --sliding-window")
    single_args = argparse.Namespace(**{**vars(args), "sliding_window": 0})
    rounds: dict[str, list[float]] = {"single": [], "hybrid": []}
    for _ in range(args.repeats):
        rounds["single"].append(statistics.median(measure(single_args, clock)))
        rounds["hybrid"].append(statistics.median(measure(args, clock)))
    groups = kv_shape(args).groups
    print(
        f"hybrid: {len(groups)} groups ({args.pattern} layers, window {args.sliding_window}); "
        f"requests={args.requests} prompt_len={args.prompt_len} steps={args.steps} "
        f"rounds={args.repeats} clock={'process_time' if args.cpu_time else 'perf_counter'}"
    )
    for name, medians in rounds.items():
        runs = ", ".join(f"{m * 1e6:.0f}" for m in medians)
        print(f"{name:>6}: median of rounds {statistics.median(medians) * 1e6:.0f} us ({runs})")
    single, hybrid = rounds["single"], rounds["hybrid"]
    print(
        f"hybrid / single: {statistics.median(hybrid) / statistics.median(single):.3f} "
        f"(medians), {min(hybrid) / min(single):.3f} (fastest rounds)"
    )


if __name__ == "__main__":
    main()
