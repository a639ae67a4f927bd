"""What a base model offers LoRA adapters: its projections, the Hugging Face module names
that map onto them, and the bytes an adapter slot takes. Torch-free (the plan reads it).

kvserve fuses projections at load (layers/attention.py, layers/mlp.py): an adapter on
``q_proj`` is the first part of the fused ``qkv`` projection, on ``up_proj`` the second part
of ``gate_up``. Phi-3's checkpoints fuse them already (``qkv_proj``, ``gate_up_proj``): an
adapter there covers the whole projection, as one part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv.accounting import lora_slot_bytes

if TYPE_CHECKING:
    from engine.model.spec import ModelSpec

QKV = "qkv"
O_PROJ = "o_proj"
GATE_UP = "gate_up"
DOWN = "down"
WHOLE = -1  # an adapter module that covers its whole fused projection

# Hugging Face module names -> (kvserve projection, part index or WHOLE).
HF_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": (QKV, 0),
    "k_proj": (QKV, 1),
    "v_proj": (QKV, 2),
    "qkv_proj": (QKV, WHOLE),
    "o_proj": (O_PROJ, WHOLE),
    "gate_proj": (GATE_UP, 0),
    "up_proj": (GATE_UP, 1),
    "gate_up_proj": (GATE_UP, WHOLE),
    "down_proj": (DOWN, WHOLE),
}


@dataclass(frozen=True)
class Projection:
    """One projection of every layer: its input width and its parts' output rows."""

    in_features: int
    parts: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.parts)

    def part_rows(self, part: int) -> tuple[int, int]:
        """``(first row, rows)`` of a part (``WHOLE``: every row)."""
        if part == WHOLE:
            return 0, self.out_features
        return sum(self.parts[:part]), self.parts[part]


@dataclass(frozen=True)
class LoRATargets:
    """The projections adapters may target in each of ``num_layers`` layers, and the slot
    width (``max_rank`` per part) every adapter is padded to."""

    num_layers: int
    projections: tuple[tuple[str, Projection], ...]
    max_rank: int

    @classmethod
    def of(cls, spec: ModelSpec, max_rank: int, dense_mlp: bool = True) -> LoRATargets:
        """A decoder's projections; the MLP's only when it is dense (not experts)."""
        inter = spec.intermediate_size if dense_mlp else 0
        return cls.for_decoder(
            spec.num_layers, spec.hidden_size, spec.q_size, spec.kv_size, inter, max_rank
        )

    @classmethod
    def for_decoder(
        cls, num_layers: int, hidden: int, q_size: int, kv_size: int, inter: int, max_rank: int
    ) -> LoRATargets:
        """The same from plain sizes (``kvserve plan``); ``inter`` 0: no dense MLP."""
        projections = [
            (QKV, Projection(hidden, (q_size, kv_size, kv_size))),
            (O_PROJ, Projection(q_size, (hidden,))),
        ]
        if inter:
            projections += [
                (GATE_UP, Projection(hidden, (inter, inter))),
                (DOWN, Projection(inter, (hidden,))),
            ]
        return cls(num_layers, tuple(projections), max_rank)

    def get(self, name: str) -> Projection | None:
        return dict(self.projections).get(name)

    def width(self, name: str) -> int:
        """Rows of an adapter slot in projection ``name``'s stacks."""
        projection = self.get(name)
        assert projection is not None
        return len(projection.parts) * self.max_rank

    @property
    def module_names(self) -> tuple[str, ...]:
        """The Hugging Face module names an adapter may target on this base."""
        names = dict(self.projections)
        return tuple(m for m, (projection, _) in HF_MODULES.items() if projection in names)

    def slot_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one adapter slot (or one adapter in the host cache)."""
        shapes = [(p.in_features, p.out_features, len(p.parts)) for _, p in self.projections]
        return lora_slot_bytes(self.num_layers, shapes, self.max_rank, dtype_bytes)
