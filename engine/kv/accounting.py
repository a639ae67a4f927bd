"""The single source of KV-cache memory arithmetic.

Everything in kvserve that talks about KV memory -- the startup log, ``kvserve plan``,
the Prometheus gauges and the scheduler's admission checks -- calls this module, so the
numbers a user plans with are the numbers the server runs with.

For a homogeneous full-attention decoder the logical payload of one sequence of ``t``
retained tokens is ``2 * L * H_kv * d * t * b`` bytes (K and V, ``L`` layers, ``H_kv`` KV
heads of dimension ``d``, ``b`` bytes per element). Quantized caches (int8, fp8) also keep
one float32 scale per token, head and K/V, which is counted here too. Stored in blocks of
``S`` tokens, a sequence occupies ``ceil(t / S)`` blocks and wastes the rest of the last
one as padding.

Models that mix sliding-window and full-attention layers keep their layers in KV groups
(engine/kv/groups.py): one pool of equal pages, a page holding one block for
``page_layers`` layers, and a block table per group. A full group of ``L_g`` layers costs
``2 * L_g * H_kv * d * t * b`` per sequence; a sliding group of window ``W`` only
``2 * L_g * H_kv * d * min(t, W) * b`` of payload, in at most ceil((W - 1) / S) + 1 blocks.
A model with one kind of layer is one group, and every figure is the formula above.

Pure Python: no torch, no model config objects, just numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv.groups import KVGroup, check_partition, page_layers

GIB = 1024**3
MIB = 1024**2

# Bytes per stored element for each KV cache dtype kvserve supports.
KV_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,
}
# Quantized formats keep a float32 scale per (token, KV head) for K and for V.
QUANTIZED_KV_DTYPES = frozenset({"fp8", "int8"})
SCALE_BYTES = 4


def resolve_kv_dtype(kv_cache_dtype: str, serving_dtype: str, requested_dtype: str) -> str:
    """The KV cache dtype ``--kv-cache-dtype kv_cache_dtype`` gives a model served in
    ``serving_dtype`` (what ``--dtype requested_dtype`` resolved to).

    ``auto`` is the serving dtype, with one exception: where ``--dtype auto`` chose float32
    (a CPU without bf16 units computes faster in float32), the cache stays bfloat16. That
    widening buys arithmetic speed, not precision, and a float32 cache would double what
    every token of every conversation costs and the bytes each decode step reads. The same
    model keeps bf16 keys and values on a machine with bf16 units, and llama.cpp keeps a
    16-bit cache whatever it computes in. ``--kv-cache-dtype float32``, or ``--dtype
    float32`` asked for by name, keeps a float32 cache. Raises ValueError for an unknown
    dtype.
    """
    if kv_cache_dtype != "auto":
        if kv_cache_dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"--kv-cache-dtype must be auto or one of {sorted(KV_DTYPE_BYTES)}, "
                f"not {kv_cache_dtype!r}"
            )
        return kv_cache_dtype
    if requested_dtype == "auto" and serving_dtype == "float32":
        return "bfloat16"
    return serving_dtype


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the cache: the model's attention shape, the KV dtype and the
    KV groups its layers form (left empty: one full-attention group of every layer, and
    filled in so, so that equal shapes compare equal however they were written)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bfloat16"
    groups: tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"unknown KV cache dtype {self.kv_dtype!r}; choose one of {sorted(KV_DTYPE_BYTES)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not self.groups:
            object.__setattr__(self, "groups", (KVGroup(tuple(range(self.num_layers))),))
        check_partition(self.groups, self.num_layers)

    @property
    def page_layers(self) -> int:
        """Layers one block (page) of the pool holds: all of them for a single group."""
        return page_layers(self.groups)

    @property
    def is_hybrid(self) -> bool:
        """More than one group, or a sliding one: blocks are kept per group."""
        groups = self.groups
        return len(groups) > 1 or groups[0].window is not None

    @property
    def element_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def is_quantized(self) -> bool:
        return self.kv_dtype in QUANTIZED_KV_DTYPES


def layer_token_bytes(shape: KVShape) -> int:
    """K and V of one token in one layer (all KV heads), including quantization scales."""
    per_head = shape.head_dim * shape.element_bytes
    if shape.is_quantized:
        per_head += SCALE_BYTES
    return 2 * shape.num_kv_heads * per_head


def bytes_per_token(shape: KVShape) -> int:
    """K and V of one token across all layers and KV heads, including quantization scales:
    what a token costs while every layer keeps it."""
    return shape.num_layers * layer_token_bytes(shape)


def payload_bytes(shape: KVShape, num_tokens: int) -> int:
    """Logical KV payload of one sequence of ``num_tokens`` tokens: 2*L*H_kv*d*t*b (+
    scales), where a sliding group counts only the tokens its window still reads."""
    per_layer = layer_token_bytes(shape)
    return sum(
        len(group.layers) * per_layer * group.retained_tokens(num_tokens) for group in shape.groups
    )


def group_payload_bytes(shape: KVShape, group: KVGroup, retained_tokens: int) -> int:
    """Payload of ``retained_tokens`` tokens (summed over sequences) in one group."""
    return len(group.layers) * layer_token_bytes(shape) * retained_tokens


def blocks_per_sequence(shape: KVShape, num_tokens: int, block_size: int) -> int:
    """Blocks (pages) one sequence holds at most while it grows to ``num_tokens``, summed
    over groups: ceil(t / S) per full group, at most ceil((W - 1) / S) + 1 per sliding one."""
    return sum(group.max_blocks(num_tokens, block_size) for group in shape.groups)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens``: ceil(t / S)."""
    return -(-num_tokens // block_size)


def padding_slots(num_tokens: int, block_size: int) -> int:
    """Unused token slots in the last block: ceil(t/S)*S - t."""
    return blocks_for_tokens(num_tokens, block_size) * block_size - num_tokens


def bytes_per_block(shape: KVShape, block_size: int) -> int:
    """Memory one KV block (a page) occupies: ``page_layers`` layers' K and V and scales
    for ``block_size`` tokens. All layers for a model of one group."""
    return shape.page_layers * layer_token_bytes(shape) * block_size


def allocated_bytes(shape: KVShape, num_blocks: int, block_size: int) -> int:
    """Memory held by ``num_blocks`` blocks, padding included."""
    return bytes_per_block(shape, block_size) * num_blocks


# Block copies (swap-out, swap-in, copy-on-write) go through one fixed staging buffer per
# side, so a copy never allocates in a step that is already short of memory. Its size
# bounds a copy chunk: the blocks of one layer's K (or V, or their scales) at a time.
COPY_STAGING_BYTES = 8 * MIB


def copy_chunk_blocks(
    shape: KVShape, block_size: int, staging_bytes: int = COPY_STAGING_BYTES
) -> int:
    """Blocks one chunk of a block copy moves: as many of one layer's K (or V) blocks as
    ``staging_bytes`` holds, at least one."""
    return max(1, staging_bytes // _layer_block_bytes(shape, block_size))


def copy_staging_bytes(
    shape: KVShape, block_size: int, staging_bytes: int = COPY_STAGING_BYTES
) -> int:
    """The staging buffer a block copy really allocates on each side (whole blocks of one
    layer, so up to one layer-block above ``staging_bytes`` when that is tiny)."""
    chunk = copy_chunk_blocks(shape, block_size, staging_bytes)
    return chunk * _layer_block_bytes(shape, block_size)


def _layer_block_bytes(shape: KVShape, block_size: int) -> int:
    # The largest per-layer slice of one block among the pool's tensors: K/V values
    # (head_dim elements per token and head) or, for quantized caches, their scales.
    per_token_head = max(shape.head_dim * shape.element_bytes, SCALE_BYTES)
    return shape.num_kv_heads * block_size * per_token_head


def num_blocks_for_budget(shape: KVShape, block_size: int, kv_budget_bytes: int) -> int:
    """How many whole blocks fit in ``kv_budget_bytes`` (never negative)."""
    return max(0, kv_budget_bytes // bytes_per_block(shape, block_size))


@dataclass(frozen=True)
class GroupPlan:
    """One KV group's share of a sequence at ``max_model_len``, for the log and ``plan``."""

    label: str  # "full" | "sliding_<W>"
    window: int | None
    num_layers: int
    blocks_per_max_len_seq: int
    payload_bytes_per_max_len_seq: int


def plan_groups(shape: KVShape, block_size: int, max_model_len: int) -> tuple[GroupPlan, ...]:
    """Per-group figures of one ``max_model_len`` sequence (empty for a non-hybrid shape)."""
    if not shape.is_hybrid:
        return ()
    return tuple(
        GroupPlan(
            label=group.label,
            window=group.window,
            num_layers=len(group.layers),
            blocks_per_max_len_seq=group.max_blocks(max_model_len, block_size),
            payload_bytes_per_max_len_seq=group_payload_bytes(
                shape, group, group.retained_tokens(max_model_len)
            ),
        )
        for group in shape.groups
    )


@dataclass(frozen=True)
class CapacityPlan:
    """What a memory budget buys: the KV pool and how many sequences it serves."""

    memory_budget_bytes: int
    weight_bytes: int
    activation_reserve_bytes: int
    kv_budget_bytes: int
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    token_capacity: int
    max_model_len: int
    blocks_per_max_len_seq: int
    max_seqs_at_max_len: int
    avg_len: int
    blocks_per_avg_len_seq: int
    max_seqs_at_avg_len: int
    # The device-side staging buffer of block copies (COPY_STAGING_BYTES, rounded to
    # whole blocks of one layer), taken from the budget before the KV pool.
    copy_staging_bytes: int = 0
    # Per KV group, for a model with more than one (or a sliding one); empty otherwise.
    groups: tuple[GroupPlan, ...] = ()
    # What the same budget holds with every layer keeping every block (an all-full cache,
    # --disable-hybrid-kv-cache-manager): its blocks and sequences at max_model_len.
    all_full_num_blocks: int = 0
    all_full_max_seqs_at_max_len: int = 0

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_max_len_seq(self) -> int:
        """Pool bytes one sequence at max_model_len holds (whole blocks, every group)."""
        return self.blocks_per_max_len_seq * self.bytes_per_block

    @property
    def hybrid_capacity_gain(self) -> float:
        """Sequences at max_model_len per byte, against an all-full cache (1.0 for a model
        of one full-attention group): the predicted factor of the hybrid KV cache."""
        if not self.groups or not self.bytes_per_max_len_seq:
            return 1.0
        full_blocks = blocks_for_tokens(self.max_model_len, self.block_size)
        all_full = full_blocks * self.block_size * self.bytes_per_token
        return all_full / self.bytes_per_max_len_seq

    @property
    def fits_one_max_len_sequence(self) -> bool:
        return self.max_seqs_at_max_len >= 1


def plan_capacity(
    shape: KVShape,
    *,
    memory_budget_bytes: int,
    weight_bytes: int,
    activation_reserve_bytes: int,
    block_size: int,
    max_model_len: int,
    avg_len: int | None = None,
    num_blocks_override: int | None = None,
    staging_bytes: int = COPY_STAGING_BYTES,
) -> CapacityPlan:
    """Size the KV pool: (budget - weights - activations - copy staging) / bytes_per_block
    blocks.

    ``num_blocks_override`` (``--num-kv-blocks``) replaces the derived block count; the
    rest of the plan is then computed from it. Concurrency figures count whole blocks per
    sequence, as the block manager allocates them.
    """
    per_block = bytes_per_block(shape, block_size)
    staging = copy_staging_bytes(shape, block_size, staging_bytes)
    kv_budget = max(0, memory_budget_bytes - weight_bytes - activation_reserve_bytes - staging)
    num_blocks = (
        num_blocks_override
        if num_blocks_override is not None
        else num_blocks_for_budget(shape, block_size, kv_budget)
    )
    avg = avg_len if avg_len is not None else max_model_len
    max_len_blocks = blocks_per_sequence(shape, max_model_len, block_size)
    avg_blocks = max(1, blocks_per_sequence(shape, avg, block_size))
    all_full = KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.kv_dtype)
    all_full_blocks = num_blocks * per_block // bytes_per_block(all_full, block_size)
    return CapacityPlan(
        memory_budget_bytes=memory_budget_bytes,
        weight_bytes=weight_bytes,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_budget_bytes=kv_budget,
        block_size=block_size,
        bytes_per_token=bytes_per_token(shape),
        bytes_per_block=per_block,
        num_blocks=num_blocks,
        token_capacity=num_blocks * block_size,
        max_model_len=max_model_len,
        blocks_per_max_len_seq=max_len_blocks,
        max_seqs_at_max_len=num_blocks // max_len_blocks if max_len_blocks else 0,
        avg_len=avg,
        blocks_per_avg_len_seq=avg_blocks,
        max_seqs_at_avg_len=num_blocks // avg_blocks,
        copy_staging_bytes=staging,
        groups=plan_groups(shape, block_size, max_model_len),
        all_full_num_blocks=all_full_blocks,
        all_full_max_seqs_at_max_len=all_full_blocks
        // blocks_for_tokens(max_model_len, block_size),
    )


def max_concurrency(num_blocks: int, seq_len: int, block_size: int) -> int:
    """Largest number of sequences of ``seq_len`` tokens that fit in ``num_blocks`` blocks."""
    need = blocks_for_tokens(seq_len, block_size)
    return num_blocks // need if need else 0


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: '93.75 MiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# -- prefix-cache tiers below the device pool ------------------------------------------------

# Every disk-tier entry is one block's bytes behind a fixed-size header (engine/kv/disk_store.py).
DISK_ENTRY_HEADER_BYTES = 512


def disk_entry_bytes(shape: KVShape, block_size: int) -> int:
    """Bytes one block occupies in the disk tier: header plus the block's payload."""
    return DISK_ENTRY_HEADER_BYTES + bytes_per_block(shape, block_size)


def host_tier_blocks(shape: KVShape, block_size: int, host_tier_bytes: int) -> int:
    """Blocks the host tier (``--kv-cache-host-size``) holds."""
    return max(0, host_tier_bytes // bytes_per_block(shape, block_size))


def disk_tier_blocks(shape: KVShape, block_size: int, disk_tier_bytes: int) -> int:
    """Blocks the disk tier (``--kv-cache-disk-size``) holds at most."""
    return max(0, disk_tier_bytes // disk_entry_bytes(shape, block_size))


@dataclass(frozen=True)
class TierCapacity:
    """One tier of the prefix cache below the device pool, for the log and ``plan``."""

    name: str  # "host" | "disk"
    num_blocks: int
    block_size: int
    capacity_bytes: int

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size


def plan_tiers(
    shape: KVShape, block_size: int, host_tier_bytes: int, disk_tier_bytes: int
) -> tuple[TierCapacity, ...]:
    """The enabled tiers (a size of 0 turns a tier off), top down."""
    tiers = []
    if host_tier_bytes > 0:
        blocks = host_tier_blocks(shape, block_size, host_tier_bytes)
        tiers.append(
            TierCapacity("host", blocks, block_size, blocks * bytes_per_block(shape, block_size))
        )
    if disk_tier_bytes > 0:
        blocks = disk_tier_blocks(shape, block_size, disk_tier_bytes)
        tiers.append(TierCapacity("disk", blocks, block_size, disk_tier_bytes))
    return tuple(tiers)


# -- LoRA adapters ------------------------------------------------------------------------------


def lora_slot_bytes(
    num_layers: int, projections: Iterable[tuple[int, int, int]], max_rank: int, dtype_bytes: int
) -> int:
    """Bytes one LoRA adapter slot takes in every layer (engine/model/layers/lora.py): per
    projection ``(in_features, out_features, parts)``, A ``[parts * max_rank, in]`` and B
    ``[parts * max_rank, out]``, zero-padded to ``max_rank`` whatever the adapter's rank.
    The engine holds ``max_loras`` slots beside the weights, and the host cache up to
    ``max_cpu_loras`` adapters in the same layout."""
    per_layer = sum(parts * max_rank * (fan_in + fan_out) for fan_in, fan_out, parts in projections)
    return num_layers * per_layer * dtype_bytes
