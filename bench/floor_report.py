"""Single-stream inter-token latency against the weight-bytes / bandwidth floor, run by run.

Reads the rounds of ``bench/compare_servers.py --interleave N --read-bandwidth``: for each
round and kvserve format, the ITL median of its load-test run, the read bandwidth measured
just before and just after that run (a torch sum of 512 MiB, as bench/decode_floor.py),
the floor (the bytes a decode token streams, ``ModelWeights.decode_nbytes``, over the mean
of the two), and the ratio ITL / floor. Then per format the median ratio over the rounds
and the worst. On a VM whose bandwidth drifts by 1.2-1.5x within minutes, a latency is
only comparable with the bandwidth of the same minute.

    PYTHONPATH=. .venv/bin/python bench/floor_report.py bench/results/DIR --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from bench.decode_floor import decode_bytes
from engine.model.weight_format import QUANTIZATION_METHODS

# kvserve-baseline: the bf16 defaults from another checkout (compare_servers --baseline-tree).
FORMATS = {
    "kvserve": "none",
    "kvserve-int8": "int8",
    "kvserve-int4": "int4",
    "kvserve-baseline": "none",
}


class Run(NamedTuple):
    """One kvserve load-test run and the bandwidth read around it (bytes/s)."""

    round_name: str
    server: str
    itl_p50_s: float
    bandwidth_before: float
    bandwidth_after: float


def run_rows(out: Path, concurrency: int) -> list[Run]:
    """Every kvserve run measured with --read-bandwidth, in round order."""
    rows = []
    for runs in sorted(out.glob("round*/runs.jsonl"), key=lambda p: int(p.parent.name[5:])):
        for line in runs.read_text().splitlines():
            run = json.loads(line)
            if run["server"] not in FORMATS or "read_bandwidth_before" not in run:
                continue
            if run["concurrency"] != concurrency:
                continue
            result = runs.parent / f"{run['server']}-c{concurrency}.json"
            itl = json.loads(result.read_text())["summary"]["latency_s"]["itl"]["p50"]
            before, after = run["read_bandwidth_before"], run["read_bandwidth_after"]
            rows.append(Run(runs.parent.name, run["server"], itl, before, after))
    return rows


def report(rows: Sequence[tuple[str, str, float, float, float]], sizes: dict[str, int]) -> str:
    """The table of ``Run``s, then per server the median and worst ITL / floor (Markdown)."""
    ratios: dict[str, list[float]] = {server: [] for server in sizes}
    lines = [
        "| round | server | ITL p50 | bandwidth before / after | floor | ITL / floor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for round_name, server, itl, before, after in rows:
        floor = sizes[server] / ((before + after) / 2)
        ratios[server].append(itl / floor)
        lines.append(
            f"| {round_name} | {server} | {itl * 1e3:.2f} ms | "
            f"{before / 1e9:.1f} / {after / 1e9:.1f} GB/s | {floor * 1e3:.2f} ms | "
            f"{itl / floor:.2f}x |"
        )
    lines += [
        "",
        "| server | bytes a token streams | runs | median ITL / floor | worst |",
        "|---|---:|---:|---:|---:|",
    ]
    for server, values in sorted(ratios.items()):
        if values:
            lines.append(
                f"| {server} | {sizes[server] / 1e6:.0f} MB | {len(values)} | "
                f"{statistics.median(values):.2f}x | {max(values):.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a compare_servers --out directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_METHODS,
        help="the weights of kvserve and kvserve-baseline (a run with --kvserve-arg="
        "--quantization=...: the same format from two checkouts)",
    )
    args = parser.parse_args()
    rows = run_rows(args.out, args.concurrency)
    if not rows:
        raise SystemExit(f"no runs with --read-bandwidth under {args.out}/round*/")
    formats = {**FORMATS, "kvserve": args.quantization, "kvserve-baseline": args.quantization}
    sizes = {server: decode_bytes(formats[server], args.dtype) for server in {r[1] for r in rows}}
    print(report(rows, sizes))


if __name__ == "__main__":
    main()
