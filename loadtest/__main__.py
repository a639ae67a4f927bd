"""``python -m loadtest`` / ``kvserve-loadtest``: concurrent multi-turn conversations
against one OpenAI-compatible server (or a router, or several replicas directly), with a
JSON result and a PNG report."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest import cli_types as types
from loadtest.config import SLO, LoadTestConfig
from loadtest.report import build_result, format_summary, write_json
from loadtest.runner import run_loadtest

PNG_DEFAULT = Path("loadtest-out/report.png")
MATPLOTLIB_HINT = "pip install 'kvserve[loadtest]' (or pip install matplotlib)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve-loadtest",
        description="Load-test an OpenAI-compatible server with concurrent multi-turn "
        "conversations; each turn re-sends the whole history plus a new user message.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _target_options(parser.add_argument_group("target"))
    _load_options(parser.add_argument_group("load"))
    _bound_options(parser.add_argument_group("bounds"))
    _report_options(parser.add_argument_group("report"))
    return parser


def _target_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--url",
        type=types.url_list,
        action="extend",
        default=None,
        help="server root URL (default http://127.0.0.1:8000); repeat it or give a comma "
        "list to drive several replicas directly (see --routing)",
    )
    group.add_argument(
        "--routing",
        choices=("conversation", "request"),
        default="conversation",
        help="several --url: pin each conversation to one replica (assigned round-robin), "
        "or send each request to the next replica in turn",
    )
    group.add_argument(
        "--replica-url",
        type=types.url_list,
        action="extend",
        default=None,
        help="a replica behind the --url router (repeatable, or a comma list): its /metrics "
        "give the per-replica figures (requests, prefix-cache hit rate, tokens, TTFT)",
    )
    group.add_argument(
        "--model",
        default=None,
        help="model name (unset: the first of /v1/models); a comma list spreads the "
        "conversations over the names round-robin (LoRA adapters of one base, say)",
    )
    group.add_argument("--api-key", default=None, help="sent as a Bearer token (unset: no header)")


def _load_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "-c",
        "--concurrency",
        type=types.int_at_least(1),
        default=8,
        help="conversations at once (Poisson mode: most open at once)",
    )
    group.add_argument(
        "-t", "--turns", type=types.int_at_least(1), default=4, help="turns per conversation"
    )
    group.add_argument(
        "-n",
        "--num-conversations",
        type=types.int_at_least(1),
        default=None,
        help="conversations in total (unset: --concurrency)",
    )
    group.add_argument(
        "--request-rate",
        type=types.number(above=0),
        default=None,
        help="Poisson arrivals at this many requests/s (unset: a closed loop)",
    )
    group.add_argument(
        "--user-len",
        type=types.length,
        default="64",
        help="words per user message: N, uniform:MEAN:HALF_WIDTH or lognormal:MEDIAN:SIGMA",
    )
    group.add_argument(
        "--system-prompt-len",
        type=types.int_at_least(0),
        default=0,
        help="words of a system prompt shared by all conversations",
    )
    group.add_argument(
        "--max-tokens", type=types.int_at_least(1), default=64, help="max_tokens per reply"
    )
    group.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM extension)"
    )
    group.add_argument(
        "--temperature", type=types.number(at_least=0), default=0.0, help="sampling temperature"
    )
    group.add_argument(
        "--think-time", type=types.number(at_least=0), default=0.0, help="seconds between turns"
    )
    group.add_argument(
        "--ramp-up",
        type=types.number(at_least=0),
        default=0.0,
        help="seconds over which the closed-loop conversations start",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of prompts, lengths, arrivals and sampling"
    )


def _bound_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--duration",
        type=types.number(above=0),
        default=None,
        help="stop sending after this many seconds (unset: when the conversations end)",
    )
    group.add_argument(
        "--max-requests",
        type=types.int_at_least(1),
        default=None,
        help="stop after sending this many requests (unset: no limit)",
    )
    group.add_argument(
        "--drain-timeout",
        type=types.number(at_least=0),
        default=30.0,
        help="seconds in-flight requests get after --duration",
    )
    group.add_argument(
        "--request-timeout",
        type=types.number(above=0),
        default=600.0,
        help="seconds one request may take before it counts as failed",
    )


def _report_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--slo-ttft", type=types.number(above=0), default=1.2, help="goodput TTFT bound, s"
    )
    group.add_argument(
        "--slo-itl", type=types.number(above=0), default=0.2, help="goodput ITL bound, s"
    )
    group.add_argument(
        "--scrape-interval",
        type=types.number(above=0),
        default=1.0,
        help="seconds between /metrics scrapes",
    )
    group.add_argument(
        "--json", type=Path, default=Path("loadtest-out/result.json"), help="result JSON path"
    )
    group.add_argument(
        "--png",
        type=Path,
        default=None,
        help=f"PNG report path (unset: {PNG_DEFAULT} when matplotlib is installed, else no "
        f"PNG; an explicit --png without matplotlib is an error: {MATPLOTLIB_HINT})",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress line")


def load_plotter() -> Callable[[dict[str, Any], Path], None] | None:
    """``plot_report``, or None without matplotlib (it is the `loadtest` extra only)."""
    try:
        from loadtest.plot import plot_report
    except ImportError:
        return None
    return plot_report


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    urls = args.url or ["http://127.0.0.1:8000"]
    return LoadTestConfig(
        url=urls[0],
        urls=tuple(urls) if len(urls) > 1 else (),
        routing=args.routing,
        replica_urls=tuple(args.replica_url or ()),
        model=_model_names(args.model)[0] if args.model else None,
        models=tuple(_model_names(args.model)) if args.model and "," in args.model else (),
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


def _model_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one load test; exit status 0 when at least one request succeeded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    plotter = load_plotter()
    if plotter is None and args.png is not None:
        parser.error(f"--png needs matplotlib: {MATPLOTLIB_HINT}")
    result = asyncio.run(run_loadtest(config, progress=not args.no_progress))
    document = build_result(result)
    write_json(document, args.json)
    print(format_summary(document))
    if plotter is None:
        print(f"wrote {args.json} (no PNG report: matplotlib is missing; {MATPLOTLIB_HINT})")
    else:
        png = args.png or PNG_DEFAULT
        plotter(document, png)
        print(f"wrote {args.json} and {png}")
    return 0 if document["summary"]["requests"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
