"""The server half of ``bench.soak``: the real kvserve app under uvicorn on 127.0.0.1,
plus one soak-only route, ``GET /soak/state``, that kvserve itself does not have.

``/soak/state`` reports the engine's counters and occupancy and, when the engine is idle
(no open stream, no running, waiting or swapped request), runs
``Scheduler.check_integrity()``. Calling it on the event loop's thread is safe only then:
the engine thread is asleep and nothing can wake it but a new request, and the soak
client sends none while it checks. Prints ``PORT n`` once it listens.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.config import EngineArgs
from server.app import build_app, serving_context
from server.routes.context import ServingContext
from server.settings import ServerSettings


def add_state_route(app: FastAPI, ctx: ServingContext, built: Any) -> None:
    @app.get("/soak/state")
    async def soak_state() -> JSONResponse:
        engine = ctx.engine
        stats = engine.stats()
        queued = stats.num_running + stats.num_waiting + stats.num_swapped
        idle = engine.num_open_streams == 0 and queued == 0
        integrity_error = None
        if idle:
            try:
                built.core.scheduler.check_integrity()
            except AssertionError as exc:
                integrity_error = repr(exc)
        return JSONResponse(
            {
                "idle": idle,
                "integrity_error": integrity_error,
                "open_streams": engine.num_open_streams,
                "device_used": stats.device_blocks.used,
                "host_used": stats.host_blocks.used,
                "preemptions": stats.preemptions_total,
                "blocks_swapped_out": stats.blocks_swapped_out_total,
                "blocks_swapped_in": stats.blocks_swapped_in_total,
                "prefix_cache_hit_tokens": stats.prefix_cache_hits_total,
                "generation_tokens": stats.generation_tokens_total,
            }
        )


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from engine.builder import build_engine

    p = argparse.ArgumentParser(prog="python -m bench.soak_server")
    p.add_argument("--model", required=True)
    p.add_argument("--num-kv-blocks", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = p.parse_args(argv)
    built = build_engine(
        EngineArgs(
            model=args.model,
            device="cpu",
            dtype="float32",
            max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            swap_space_gib=0.05,
            max_num_seqs=64,
            max_num_batched_tokens=args.max_num_batched_tokens,
            preemption_mode="auto",
        )
    )
    # Swap a victim out once it holds a block's worth of tokens: both preemption modes run.
    # (swap_min_tokens is a SchedulerConfig knob without a serve flag.)
    scheduler = built.core.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, swap_min_tokens=args.block_size * 8)
    ctx = serving_context(built, ServerSettings(served_model_names=("soak",)))
    app = build_app(ctx)
    add_state_route(app, ctx, built)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
