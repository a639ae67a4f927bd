"""The sampler's draw, before and after: the exponential race (a vocabulary of noise per
row, each seeded row from its own generator) against the inverse-CDF draw (one uniform per
row), in one engine, interleaved, at 32 concurrent seeded requests (temperature 0.8).

    PYTHONPATH=. .venv/bin/python bench/bench_sampler.py

The embedded SmolLM2 in float32 through ``EngineCore`` with the token budget (no step-time
bound) and no prefix cache, as bench_structured.py runs it; medians of 3 repeats.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.bench_structured import QUESTION, machine, run_load
from engine.builder import build_engine
from engine.config import EngineArgs
from engine.sampler import Sampler, SamplingRow


def exponential_race(self: Sampler, probs: torch.Tensor, rows: list[SamplingRow]) -> Any:
    """The draw the sampler used before: argmax of p / E, E ~ Exp(1) per vocabulary entry."""
    noise = torch.empty_like(probs)
    noise.exponential_(generator=self._shared_generator(probs.device))
    for i, row in enumerate(rows):
        if row.seed is not None and not row.params.greedy:
            noise[i].exponential_(generator=self._generator_for(row, probs.device))
    return (probs / noise).argmax(dim=-1)


def main() -> None:
    print(machine())
    built = build_engine(
        EngineArgs(dtype="float32", enable_prefix_caching=False, max_step_time_ms=0)
    )
    chat = [{"role": "user", "content": QUESTION}]
    text = built.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = list(built.tokenizer.encode(text, add_special_tokens=False))
    run_load(built, prompt, 32, 32, grammar=False)  # warm-up
    draws = {"exponential race": exponential_race, "inverse CDF": Sampler.draw}
    rates: dict[str, list[float]] = {name: [] for name in draws}
    for repeat in range(3):
        order = list(draws) if repeat % 2 == 0 else list(reversed(draws))
        for name in order:
            Sampler.draw = draws[name]  # type: ignore[method-assign]
            seconds, _, tokens = run_load(built, prompt, 32, 32, grammar=False)
            rates[name].append(tokens / seconds)
            print(f"repeat {repeat} {name}: {tokens / seconds:.1f} out tok/s", flush=True)
    old, new = (statistics.median(rates[name]) for name in draws)
    print(f"median: exponential race {old:.1f}, inverse CDF {new:.1f} tok/s ({new / old:.2f}x)")


if __name__ == "__main__":
    main()
