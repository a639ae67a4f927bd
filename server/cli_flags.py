"""Command-line flags that more than one ``kvserve`` command takes.

Below both server/cli.py (``serve``, which also builds the parser and registers ``plan``)
and server/plan.py, so a flag both commands accept is defined once and neither command's
module imports the other's. Torch-free: ``kvserve plan`` imports it.
"""

from __future__ import annotations

import argparse
import json
import os

from engine.config import LoRAConfig

# vLLM's switch for the runtime load/unload routes; kvserve honours it too.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_tier_flags(group: argparse._ArgumentGroup) -> None:
    """Flags of the tiered prefix cache (engine/kv/tiers.py); shared with ``plan``."""
    group.add_argument(
        "--kv-cache-host-size",
        type=float,
        default=0.0,
        help="host tier of the prefix cache, GiB (its own pool, not --swap-space; 0 = off)",
    )
    group.add_argument(
        "--kv-cache-disk-dir",
        default=None,
        help="directory of the disk tier of the prefix cache (kept across restarts)",
    )
    group.add_argument(
        "--kv-cache-disk-size", type=float, default=4.0, help="disk tier bound, GiB (LRU)"
    )


def add_lora_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """LoRA adapters (engine/lora/; vLLM's flag names); shared with ``plan``. Returns the
    group, for ``serve``'s own LoRA flag (``add_runtime_lora_flag``)."""
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model: a request names one in 'model'",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories served from the start, as name=path or vLLM's JSON "
        '\'{"name": "mine", "path": "/adapters/mine"}\' (needs --enable-lora)',
    )
    group.add_argument(
        "--max-loras", type=int, default=1, help="distinct adapters in one step (their slots)"
    )
    group.add_argument(
        "--max-lora-rank", type=int, default=16, help="the highest adapter rank served"
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in host memory, LRU (default: --max-loras)",
    )
    return group


def add_runtime_lora_flag(group: argparse._ArgumentGroup) -> None:
    """``serve``'s switch for the load/unload routes (``plan`` has no routes to switch)."""
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter: any API client "
        f"can then load adapter directories from this machine (or set {RUNTIME_LORA_ENV}=true)",
    )


def lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path`` or ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            name, path = spec["name"], spec["path"]
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(
                f'--lora-modules JSON must be {{"name": ..., "path": ...}}: {exc}'
            ) from exc
        return str(name), str(path)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """``--allow-runtime-lora-updating``, or vLLM's environment variable set to 1 or true
    (what vLLM accepts), so a deployment written for vLLM keeps its routes."""
    env = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
    return bool(args.allow_runtime_lora_updating) or env


def lora_config_from(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRA config of ``--enable-lora`` and its flags (None when off); ValueError when
    adapters are named without it or a bound is invalid."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=tuple(args.lora_modules),
    )
