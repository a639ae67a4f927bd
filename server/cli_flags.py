"""Command-line flags that more than one ``kvserve`` command takes.

Below both server/cli.py (``serve``, which also builds the parser and registers ``plan``)
and server/plan.py, so a flag both commands accept is defined once and neither command's
module imports the other's. Torch-free: ``kvserve plan`` imports it.
"""

from __future__ import annotations

import argparse


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
