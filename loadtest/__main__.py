"""``python -m loadtest`` / ``kvserve-loadtest``: concurrent multi-turn conversations
against one OpenAI-compatible server, with a JSON result and a PNG report."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest.config import SLO, LengthDist, LoadTestConfig
from loadtest.plot import plot_report
from loadtest.report import build_result, format_summary, write_json
from loadtest.runner import run_loadtest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve-loadtest",
        description="Load-test an OpenAI-compatible server with concurrent multi-turn "
        "conversations; each turn re-sends the whole history plus a new user message.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    target = parser.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="server root URL")
    target.add_argument("--model", default=None, help="model name (default: first listed)")
    target.add_argument("--api-key", default=None, help="sent as a Bearer token")
    load = parser.add_argument_group("load")
    load.add_argument(
        "-c",
        "--concurrency",
        type=int,
        default=8,
        help="conversations at once (Poisson mode: most open at once)",
    )
    load.add_argument("-t", "--turns", type=int, default=4, help="turns per conversation")
    load.add_argument(
        "-n",
        "--num-conversations",
        type=int,
        default=None,
        help="conversations in total (default: --concurrency)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s instead of a closed loop",
    )
    load.add_argument(
        "--user-len",
        type=LengthDist.parse,
        default=LengthDist(),
        help="words per user message: N, uniform:MEAN:HALF_WIDTH or lognormal:MEDIAN:SIGMA",
    )
    load.add_argument(
        "--system-prompt-len",
        type=int,
        default=0,
        help="words of a system prompt shared by all conversations",
    )
    load.add_argument("--max-tokens", type=int, default=64, help="max_tokens per reply")
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    load.add_argument(
        "--ramp-up",
        type=float,
        default=0.0,
        help="seconds over which the closed-loop conversations start",
    )
    load.add_argument("--seed", type=int, default=0)
    bounds = parser.add_argument_group("bounds")
    bounds.add_argument(
        "--duration", type=float, default=None, help="stop sending after this many seconds"
    )
    bounds.add_argument("--max-requests", type=int, default=None)
    bounds.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after --duration",
    )
    bounds.add_argument("--request-timeout", type=float, default=600.0)
    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft", type=float, default=1.2, help="goodput TTFT bound, s")
    report.add_argument("--slo-itl", type=float, default=0.2, help="goodput ITL bound, s")
    report.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes"
    )
    report.add_argument("--json", type=Path, default=Path("loadtest-out/result.json"))
    report.add_argument("--png", type=Path, default=Path("loadtest-out/report.png"))
    report.add_argument("--no-progress", action="store_true", help="no progress line")
    return parser


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    return LoadTestConfig(
        url=args.url,
        model=args.model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        turns=args.turns,
        num_conversations=args.num_conversations,
        request_rate=args.request_rate,
        user_len=args.user_len,
        system_prompt_len=args.system_prompt_len,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        think_time_s=args.think_time,
        ramp_up_s=args.ramp_up,
        duration_s=args.duration,
        max_requests=args.max_requests,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        scrape_interval_s=args.scrape_interval,
        seed=args.seed,
        slo=SLO(ttft_s=args.slo_ttft, itl_s=args.slo_itl),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one load test; exit status 0 when at least one request succeeded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    result = asyncio.run(run_loadtest(config, progress=not args.no_progress))
    document = build_result(result)
    write_json(document, args.json)
    plot_report(document, args.png)
    print(format_summary(document))
    print(f"wrote {args.json} and {args.png}")
    return 0 if document["summary"]["requests"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
