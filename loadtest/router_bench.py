"""kvserve replicas behind vllm-router: the same multi-turn load through each routing
policy and replica count, then a failover run. One command, one JSON:

    .venv/bin/python -m loadtest.router_bench --router /tmp/kvserve-router/bin/vllm-router

The replicas start once (the most any run needs; starting them is most of the time on a
small machine). For every replica count (``--replicas 2,3``) and policy (``kv_aware`` fed
by kvserve's KV events, ``cache_aware``, ``round_robin``) a fresh router (an empty index)
is started in front of the first N replicas and the same load runs. Each run's seed is
``--seed`` plus its index: the same shape of load (conversations, turns, lengths) with
other words, so no run finds an earlier run's conversations or system prompt cached. The
failover run comes last: ``--failover-replicas`` replicas under ``kv_aware``; ``--kill-at``
seconds into the load the replica with the most running requests gets SIGKILL. Results:
``OUT/router_bench.json`` (every run's figures) and each run's load-test JSON beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.cluster import ROUTER_POLICIES, Replica, ReplicaGroup, Router
from loadtest.config import LengthDist, LoadTestConfig
from loadtest.failover import failover_figures
from loadtest.report import build_result, write_json
from loadtest.runner import run_loadtest
from loadtest.scrape import METRICS, parse_metrics


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.router_bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--router", default=os.environ.get("KVSERVE_VLLM_ROUTER") or shutil.which("vllm-router"),
        help="vllm-router binary (default: $KVSERVE_VLLM_ROUTER, else on PATH)")  # fmt: skip
    add("--out", type=Path, default=Path("bench/results/router"), help="output directory")
    add("--replicas", default="2,3", help="replica counts, comma-separated")
    add("--policies", default=",".join(ROUTER_POLICIES), help="router policies")
    add("--model", default=None, help="kvserve --model (default: the embedded SmolLM2)")
    add("--served-model-name", default="SmolLM2-135M-Instruct")
    add("--replica-args", default="--kernels torch --num-kv-blocks 512 --max-model-len 2048",
        help="extra kvserve flags of every replica")  # fmt: skip
    add("--conversations", type=int, default=16)
    add("--concurrency", type=int, default=8)
    add("--turns", type=int, default=4)
    add("--user-len", type=int, default=40, help="words per user turn")
    add("--system-prompt-len", type=int, default=96, help="words of the shared system prompt")
    add("--max-tokens", type=int, default=24)
    add("--request-timeout", type=float, default=120.0)
    add("--seed", type=int, default=0)
    add("--failover-replicas", type=int, default=3, help="0: no failover run")
    add("--kill-at", type=float, default=20.0, help="seconds into the failover load")
    return parser


def _load(
    args: argparse.Namespace, router: Router, replicas: Sequence[Replica], seed: int
) -> LoadTestConfig:
    return LoadTestConfig(
        url=router.url,
        replica_urls=tuple(r.url for r in replicas),
        model=args.served_model_name,
        concurrency=args.concurrency,
        num_conversations=args.conversations,
        turns=args.turns,
        user_len=LengthDist("fixed", args.user_len),
        system_prompt_len=args.system_prompt_len,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        request_timeout_s=args.request_timeout,
        scrape_interval_s=1.0,
        seed=seed,
    )


def _group(args: argparse.Namespace, count: int) -> ReplicaGroup:
    replica_args = tuple(args.replica_args.split())
    if args.model:
        replica_args = ("--model", args.model, *replica_args)
    return ReplicaGroup(
        count=count,
        served_name=args.served_model_name,
        args=replica_args,
        log_dir=args.out / "logs",
    )


def _router(args: argparse.Namespace, replicas: Sequence[Replica], policy: str) -> Router:
    name = f"{policy}-{len(replicas)}"
    return Router(
        binary=args.router,
        replicas=replicas,
        policy=policy,
        served_name=args.served_model_name,
        args=("--log-level", "warning"),
        log=args.out / "logs" / f"router-{name}.log",
    )


def row_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run that the comparison table shows."""
    summary, replicas = doc["summary"], doc["replicas"]
    ttft = summary["latency_s"]["ttft"]
    return {
        "prefix_cache_hit_rate": replicas["aggregate"]["prefix_cache_hit_rate"],
        "ttft_p50_s": ttft["p50"],
        "ttft_p95_s": ttft["p95"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "request_rate": summary["throughput"]["request_rate"],
        "completed": summary["requests"]["completed"],
        "failed": summary["requests"]["failed"],
        "duration_s": summary["duration_s"],
        "requests_per_replica": [r["requests_finished"] for r in replicas["per_replica"]],
        "hit_rate_per_replica": [r["prefix_cache_hit_rate"] for r in replicas["per_replica"]],
    }


def _router_worker_metrics(router: Router) -> list[str]:
    """The router's own per-worker counters (successes, failures, health), as text lines."""
    try:
        text = httpx.get(router.metrics_url, timeout=5.0).text
    except httpx.HTTPError:
        return []
    return [line for line in text.splitlines() if "worker=" in line and not line.startswith("#")]


def run_policy(
    args: argparse.Namespace, replicas: Sequence[Replica], policy: str, seed: int
) -> dict[str, Any]:
    name = f"{policy}-{len(replicas)}"
    print(f"== {name}: load {os.getloadavg()[0]:.1f}", flush=True)
    with _router(args, replicas, policy) as router:
        config = _load(args, router, replicas, seed)
        result = asyncio.run(run_loadtest(config, progress=False))
        router_lines = _router_worker_metrics(router)
    doc = build_result(result)
    write_json(doc, args.out / f"{name}.json")
    return {"policy": policy, "replicas": len(replicas), "seed": seed, **row_of(doc),
            "router_metrics": router_lines}  # fmt: skip


def _busiest(replicas: Sequence[Replica]) -> Replica:
    """The replica with the most running requests now (the last one on a tie)."""
    running: list[float] = []
    for replica in replicas:
        try:
            text = httpx.get(f"{replica.url}/metrics", timeout=5.0).text
            running.append(parse_metrics(text, METRICS).get("num_running", 0.0))
        except httpx.HTTPError:
            running.append(-1.0)
    best = max(running)
    return [r for r, n in zip(replicas, running, strict=True) if n == best][-1]


async def _load_with_kill(
    config: LoadTestConfig, replicas: Sequence[Replica], kill_at: float
) -> tuple[Any, float, Replica]:
    """Run the load; SIGKILL the busiest replica ``kill_at`` s in.
    Returns the result, the kill time (run time, within milliseconds) and the victim."""
    start = time.perf_counter()

    async def kill() -> tuple[float, Replica]:
        await asyncio.sleep(kill_at)
        victim = await asyncio.to_thread(_busiest, replicas)
        assert victim.managed is not None
        victim.managed.process.kill()
        return time.perf_counter() - start, victim

    kill_task = asyncio.create_task(kill())
    result = await run_loadtest(config, progress=False)
    kill_t, victim = await kill_task
    return result, kill_t, victim


def run_failover(
    args: argparse.Namespace, replicas: Sequence[Replica], seed: int
) -> dict[str, Any]:
    name = f"failover-kv_aware-{len(replicas)}"
    print(f"== {name}: load {os.getloadavg()[0]:.1f}", flush=True)
    with _router(args, replicas, "kv_aware") as router:
        config = _load(args, router, replicas, seed)
        result, kill_t, victim = asyncio.run(_load_with_kill(config, replicas, args.kill_at))
        router_lines = _router_worker_metrics(router)
    doc = build_result(result)
    write_json(doc, args.out / f"{name}.json")
    figures = failover_figures(doc, kill_t, victim.url, args.request_timeout)
    return {"replicas": len(replicas), "seed": seed, **row_of(doc), **figures,
            "router_metrics": router_lines}  # fmt: skip


def _machine(router: str) -> dict[str, Any]:
    def sh(command: str) -> str:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    pip = Path(router).parent / "pip"  # the router's own venv, when it has one
    return {
        "cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"),
        "flags": sh("lscpu | grep -o 'avx512_bf16\\|avx512_vnni\\|avx2' | sort -u").split(),
        "cores": os.cpu_count(),
        "commit": sh("git rev-parse --short HEAD"),
        "router": sh(f"{pip} show vllm-router 2>/dev/null | grep '^Version'") or router,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.router or not Path(args.router).exists():
        print("no vllm-router binary: pass --router or set KVSERVE_VLLM_ROUTER", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    document: dict[str, Any] = {
        "started_at": started,
        "command": " ".join(["python -m loadtest.router_bench", *(argv or sys.argv[1:])]),
        "machine": {**_machine(args.router), "load_at_start": os.getloadavg()},
        "load": {k: v for k, v in vars(args).items() if k not in ("out", "router")},
        "runs": [],
    }
    counts = [int(n) for n in args.replicas.split(",")]
    seed = args.seed
    with _group(args, max([*counts, args.failover_replicas])) as group:
        document["machine"]["load_after_startup"] = os.getloadavg()
        for count in counts:
            for policy in args.policies.split(","):
                run = run_policy(args, group.replicas[:count], policy, seed)
                document["runs"].append(run)
                write_json(document, args.out / "router_bench.json")
                seed += 1
        if args.failover_replicas:
            failover = run_failover(args, group.replicas[: args.failover_replicas], seed)
            document["failover"] = failover
    document["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(document, args.out / "router_bench.json")
    print(format_table(document))
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(document: dict[str, Any]) -> str:
    """The runs as a Markdown table, and the failover figures."""
    lines = [
        "| replicas | policy | prefix-cache hit rate | TTFT p50 ms | TTFT p95 ms | out tok/s "
        "| req/s | failed | requests per replica |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in document["runs"]:
        lines.append(
            f"| {run['replicas']} | {run['policy']} | {_pct(run['prefix_cache_hit_rate'])} "
            f"| {_ms(run['ttft_p50_s'])} | {_ms(run['ttft_p95_s'])} "
            f"| {run['output_tokens_per_s']:.1f} | {run['request_rate']:.2f} | {run['failed']} "
            f"| {' / '.join(f'{n:g}' for n in run['requests_per_replica'] if n is not None)} |"
        )
    failover = document.get("failover")
    if failover:
        lines.append("")
        lines.append("failover: " + ", ".join(
            f"{k} {v}" for k, v in failover.items() if k != "router_metrics"
        ))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
