"""What the page's totals panel and planner show: the numbers the startup log prints.

Everything comes from the built engine's ``CapacityPlan`` and ``KVShape``, i.e. from
engine/kv/accounting.py; the page's planner evaluates ``2 x L x H_kv x d_head x t x b``
with the per-token figures given here, as ``kvserve plan`` does.
"""

from __future__ import annotations

from typing import Any

from engine.kv.block_map import kv_shape_facts


def startup_facts(built: Any, host_blocks: int) -> dict[str, Any]:
    """Model, KV shape and pool totals of a ``BuiltEngine`` (engine/builder.py)."""
    plan = built.plan
    shape = kv_shape_facts(built.kv_shape, plan.block_size)
    return {
        "model": str(built.model_name),
        "device": str(built.device),
        "dtype": str(built.dtype),
        "max_model_len": int(built.max_model_len),
        "kv_shape": shape,
        "device_blocks": plan.num_blocks,
        "token_capacity": plan.token_capacity,
        "device_kv_bytes": plan.kv_pool_bytes,
        "host_blocks": host_blocks,
        "host_kv_bytes": host_blocks * shape["bytes_per_block"],
        "weight_bytes": plan.weight_bytes,
        "activation_reserve_bytes": plan.activation_reserve_bytes,
        "memory_budget_bytes": plan.memory_budget_bytes,
        "kv_budget_bytes": plan.kv_budget_bytes,
        "max_seqs_at_max_len": plan.max_seqs_at_max_len,
    }
