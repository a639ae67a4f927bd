"""Speculative decoding where it pays: "copy this text with a small edit", one stream.

Runs kvserve on the embedded SmolLM2 -- plain, and with n-gram speculation (``--spec``
JSON) -- one server at a time, alternating every round (the order rotated: this VM's
memory bandwidth drifts), and sends each the same greedy streaming request after a
warm-up: a 300-token passage to repeat with one word changed. Prints per round the
output tokens, the end-to-end and decode tokens/s (decode: after the first token), and
the speculation counters from /metrics; then whether the texts were identical in every
round, the medians and the per-round ratios.

    PYTHONPATH=. .venv/bin/python bench/bench_speculative.py --rounds 5 \
        --out bench/results/speculative
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from compare_servers import (  # noqa: E402  (bench/ is not a package)
    ServerSpec,
    _kvserve,
    start_server,
    stop_server,
    stream_chat,
    wait_ready,
    write_report,
)

PASSAGE = (
    "On Tuesday morning the harbour office opened at seven, as it had every working day "
    "for forty years. The clerk unlocked the front door, lit the stove in the back room "
    "and wrote the date at the top of a fresh page in the ledger. Three fishing boats had "
    "come in during the night: the Marianne with cod and haddock, the Blue Heron with "
    "nothing at all because her nets had torn on the rocks past the lighthouse, and a "
    "small boat from the next village whose skipper wanted to sell his mackerel before the "
    "market opened. The clerk weighed the catch, noted the prices and sent a boy to fetch "
    "the harbour master, who arrived a little after eight with a cup of tea in one hand "
    "and the weather report in the other. A storm was expected by Tuesday evening, so the "
    "boats would stay in port, the ferry to the island would not run, and the fishermen "
    "would spend the afternoon mending nets in the long shed by the slipway. By noon the "
    "sky had turned grey, the gulls had gone quiet and the first drops of rain were "
    "falling on the quay. The clerk closed the ledger, banked the stove and went home "
    "early, as the harbour master had told everyone to do. The next morning the storm had "
    "passed. The boats went out again before dawn, the ferry left for the island at nine, "
    "and the clerk opened a fresh page in the ledger and wrote the date at the top of it, "
    "just as he had done the day before and every day before that."
)
INSTRUCTION = (
    "Repeat the following text exactly, word for word, but write Friday instead of "
    "Tuesday. Output only the text.\n\n"
)
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")


def stream_once(url: str, max_tokens: int) -> dict[str, object]:
    """One greedy streaming chat request; token timing from the SSE chunks."""
    body = {
        "messages": [{"role": "user", "content": INSTRUCTION + PASSAGE}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    text, first, completion = [], None, 0
    started = time.perf_counter()
    for chunk in stream_chat(url, body):
        if chunk.get("usage"):
            completion = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            piece = choice["delta"].get("content")
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    ended = time.perf_counter()
    assert first is not None, "no content streamed"
    return {
        "text": "".join(text),
        "tokens": completion,
        "e2e_tok_s": completion / (ended - started),
        "decode_tok_s": (completion - 1) / (ended - first),
        "ttft_s": first - started,
    }


def spec_counters(url: str) -> dict[str, float]:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    counters = {}
    for name in SPEC_COUNTERS:
        match = re.search(rf"^kvserve_spec_decode_{name}_total\{{[^}}]*\}} (\S+)$", metrics, re.M)
        counters[name] = float(match.group(1)) if match else 0.0
    return counters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument(
        "--spec", default='{"method": "ngram", "num_speculative_tokens": 4}', help="JSON"
    )
    parser.add_argument("--kvserve-arg", action="append", default=[], help="for both servers")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the servers")
    parser.add_argument("--out", type=Path, default=Path("bench/results/speculative"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    specs = [
        ServerSpec("kvserve", _kvserve(())),
        ServerSpec("kvserve-spec", _kvserve(("--speculative-config", args.spec))),
    ]
    results: dict[str, list[dict[str, object]]] = {spec.name: [] for spec in specs}
    for round_index in range(args.rounds):
        order = specs if round_index % 2 == 0 else specs[::-1]
        for spec in order:
            run = measure_alone(spec, args)
            results[spec.name].append(run)
            print(f"round {round_index + 1} {spec.name}: {summary_line(run)}", flush=True)
    report(results, args.out)
    return 0


def measure_alone(spec: ServerSpec, args: argparse.Namespace) -> dict[str, object]:
    """Start one server, warm it up, run the request once, stop it. One server at a time:
    on this VM a second kvserve process, even SIGSTOPped, slowed the measured one by ~20%
    (98 vs 118 tok/s), so the two are never up together."""
    process, url = start_server(spec, args, args.out)
    try:
        wait_ready(process, url)
        stream_once(url, 16)  # warm-up: lazy initialisation is not measured
        before = spec_counters(url)
        run = stream_once(url, args.max_tokens)
        after = spec_counters(url)
    finally:
        stop_server(process)
    run["spec"] = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    return run


def summary_line(run: dict[str, object]) -> str:
    spec = run["spec"]
    assert isinstance(spec, dict)
    drafts = spec["num_drafts"]
    accepted = f", {spec['num_emitted_tokens'] / drafts:.2f} tokens/verification" if drafts else ""
    return (
        f"{run['tokens']} tokens, {run['e2e_tok_s']:.1f} tok/s end to end, "
        f"{run['decode_tok_s']:.1f} decode, TTFT {run['ttft_s'] * 1000:.0f} ms{accepted}"
    )


def report(results: dict[str, list[dict[str, object]]], out: Path) -> None:
    plain, spec = results["kvserve"], results["kvserve-spec"]
    identical = all(a["text"] == b["text"] for a, b in zip(plain, spec, strict=True))
    lines = [f"identical greedy text in every round: {identical}"]
    for key in ("e2e_tok_s", "decode_tok_s"):
        ratios = [float(b[key]) / float(a[key]) for a, b in zip(plain, spec, strict=True)]  # type: ignore[arg-type]
        medians = [statistics.median(float(r[key]) for r in runs) for runs in (plain, spec)]  # type: ignore[arg-type]
        lines.append(
            f"{key}: plain {medians[0]:.1f}, speculative {medians[1]:.1f} (median); "
            f"ratio per round {', '.join(f'{r:.2f}x' for r in ratios)}; "
            f"median {statistics.median(ratios):.2f}x"
        )
    write_report(out, "summary.txt", "\n".join(lines), results)


if __name__ == "__main__":
    raise SystemExit(main())
