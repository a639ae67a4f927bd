"""Where a single-stream decode step goes: operators vs Python and dispatch.

The embedded model (bf16, or ``--quantization int8/int4``) through ``EngineCore`` (no
HTTP), one greedy request of a 256-token prompt (``--requests N``: N of them, each step N
rows); after 100 warm-up steps, 200 steps run
under torch's profiler. Reported:
wall time per step, the operators' self time per step (every aten and kvserve op), and the
rest (the Python of the engine and the model, and the dispatcher) as a share of the step.
``--bf16-kernel off`` turns the few-row bf16 kernel off on the same engine (the "before").

    PYTHONPATH=. .venv/bin/python bench/profile_decode_step.py --bf16-kernel on
    PYTHONPATH=. .venv/bin/python bench/profile_decode_step.py --bf16-kernel off --top 10
    PYTHONPATH=. .venv/bin/python bench/profile_decode_step.py --quantization int4 --top 10
    PYTHONPATH=. .venv/bin/python bench/profile_decode_step.py --quantization int4 --ab-rounds 3
    PYTHONPATH=. .venv/bin/python bench/profile_decode_step.py --requests 32 --steps 50 --top 8
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.model.layers.linear import DenseLinear, linear_layers
from engine.model.weight_format import QUANTIZATION_METHODS
from engine.request import Request, SamplingParams


def bf16_kernel_layers(core: object) -> list[DenseLinear]:
    """The model's dense layers that take the few-row bf16 kernel (none on a CPU without
    AVX512_BF16: the builder only turns it on where it runs)."""
    weights = core.runner.model.weights  # type: ignore[attr-defined]
    linears = [weights.lm_head] + [
        linear for layer in weights.layers for linear in linear_layers(layer)
    ]
    return [x for x in linears if isinstance(x, DenseLinear) and x.rowwise]


def set_fast_decode(core: object, on: bool) -> object:
    """Rebuilds the model's one-call decode path for its current kernels (or turns it off)
    and returns it; None on a checkout that predates it (before/after runs)."""
    model = core.runner.model  # type: ignore[attr-defined]
    if not hasattr(model, "fast_decode"):
        return None
    from engine.model.layers.decoder import fast_decode_path

    built = fast_decode_path(model)
    model.fast_decode = built if on else None
    return built


def compare_fast_decode(core: object, fast_decode: object, args: argparse.Namespace) -> None:
    """Alternates the fast decode path on and off on one engine, --steps steps each."""
    model = core.runner.model  # type: ignore[attr-defined]
    for _ in range(args.ab_rounds):
        for on in (True, False):
            model.fast_decode = fast_decode if on else None
            for _ in range(10):
                core.step()  # type: ignore[attr-defined]
            start = time.perf_counter()
            for _ in range(args.steps):
                core.step()  # type: ignore[attr-defined]
            seconds = (time.perf_counter() - start) / args.steps
            state = "on " if on else "off"
            print(f"{args.quantization} fast decode {state}: {seconds * 1e3:.2f} ms a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16-kernel", choices=["on", "off"], default="on")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="none")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="activations (float32: what --dtype auto picks on a CPU without bf16 units)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the server's flag")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--requests", type=int, default=1, help="sequences decoding together (rows a step)"
    )
    parser.add_argument("--top", type=int, default=0, help="also print the N costliest ops")
    parser.add_argument(
        "--no-torch-profiler",
        action="store_true",
        help="time the steps only (for an outside sampler such as py-spy)",
    )
    parser.add_argument("--fast-decode", choices=["on", "off"], default="on")
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=0,
        help="instead: N rounds of --steps steps with the fast decode path on, then off",
    )
    args = parser.parse_args()
    built = build_engine(
        EngineArgs(
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            enable_prefix_caching=False,
            max_step_time_ms=0,
        )
    )
    core = built.core
    layers = bf16_kernel_layers(core)
    if not layers and args.quantization == "none":
        print("the bf16 kernel is not in use on this CPU (no AVX512_BF16): torch's path only")
    for layer in layers:
        layer.rowwise = args.bf16_kernel == "on"
    fast_decode = set_fast_decode(core, args.fast_decode == "on")
    steps = args.steps * (1 + 2 * args.ab_rounds) + 20 * args.ab_rounds
    params = SamplingParams(max_tokens=100 + steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):  # distinct prompts: nothing shared between the sequences
        prompt = list(range(100 + i, 356 + i))
        core.add_request([Request(f"r{i}", prompt, params, eos_token_ids=built.eos_token_ids)])
    for _ in range(100):
        core.step()
    if args.ab_rounds:
        compare_fast_decode(core, fast_decode, args)
        return
    if args.no_torch_profiler:
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        print(
            f"{args.quantization}: {(time.perf_counter() - start) * 1e3 / args.steps:.2f} ms a step"
        )
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    ops = sum(event.self_cpu_time_total for event in events) / 1e6
    per_step = 1e3 / args.steps
    print(
        f"{args.quantization}, bf16 kernel {args.bf16_kernel}: "
        f"{wall * per_step:.2f} ms a step (profiled); "
        f"operators {ops * per_step:.2f} ms; Python and dispatch "
        f"{(wall - ops) * per_step:.2f} ms = {100 * (wall - ops) / wall:.0f}% of the step"
    )
    if args.top:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
