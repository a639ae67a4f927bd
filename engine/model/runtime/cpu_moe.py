"""A mixture-of-experts layer in one native call (``torch.ops.kvserve.moe_forward``,
kernels/csrc/moe.cpp) instead of ~10 dispatched ops per chosen expert.

layers/moe.py's grouped loop makes ~5,000 op calls in a 32-sequence step of a 32-expert,
16-layer model, and a decode step's experts are small matrices that two threads split
badly. The native op routes (the same ATen calls as layers/routing.py), runs the chosen
experts one per thread with the same kernels, and adds their outputs in the same order:
bit-identical to the loop, but for int8 experts given more rows than their few-row kernel
takes (four at a time here, fbgemm in Python). ``NativeMoE.build`` describes the layer
once, as cpu_decode.py describes dense layers; layers/moe.py sends it decode-sized steps,
and the one-call decode path (cpu_decode.py) runs it for a few decodes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.layers.linear import DenseLinear, Linear
from engine.model.layers.mlp import SILU, ClampedSwiGLU, GatedMLP
from engine.model.layers.routing import TOPK_SOFTMAX, Routing
from engine.model.runtime.cpu_decode import LinearKind, dense_kind, projection_operands

_NO_BIAS = torch.empty(0)


class ExpertActivation(enum.IntEnum):
    """csrc/moe.cpp's ExpertActivation."""

    SILU = 0
    CLAMPED_SWIGLU = 1


class RoutingRule(enum.IntEnum):
    """csrc/moe.cpp's RoutingRule."""

    SOFTMAX_TOPK = 0
    TOPK_SOFTMAX = 1


@dataclass(frozen=True)
class NativeMoE:
    """One MoE layer as ``moe_forward`` takes it: ``torch.classes.kvserve.MoEWeights``
    (csrc/moe.h), built once, so a step hands over one object rather than six tensors per
    expert."""

    weights: torch.ScriptObject

    @classmethod
    def build(
        cls, router: DenseLinear, experts: Sequence[GatedMLP], routing: Routing, dtype: torch.dtype
    ) -> NativeMoE | None:
        """The op's view of the layer on ``dtype`` activations, or None where an expert has
        a projection without a native kernel or an activation the op does not run."""
        activation = _activation(experts)
        if activation is None:
            return None
        tensors: list[torch.Tensor] = []
        kinds: list[int] = []
        for expert in experts:
            for linear in (expert.gate_up, expert.down):
                operands = _operands(linear, dtype)
                if operands is None:
                    return None
                kinds.append(int(operands[0]))
                tensors += operands[1:]
        swiglu = experts[0].activation
        alpha, limit = (swiglu.alpha, swiglu.limit) if isinstance(swiglu, ClampedSwiGLU) else (0, 0)
        rule = (
            RoutingRule.TOPK_SOFTMAX if routing.rule == TOPK_SOFTMAX else RoutingRule.SOFTMAX_TOPK
        )
        weights = torch.classes.kvserve.MoEWeights(
            tensors,
            kinds,
            router.weight,
            _NO_BIAS if router.bias is None else router.bias,
            int(dense_kind(router)),
            routing.top_k,
            int(rule),
            routing.renormalize,
            int(activation),
            float(alpha),
            float(limit),
        )
        return cls(weights)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x`` ``[tokens, hidden]``."""
        out = torch.empty_like(x)
        torch.ops.kvserve.moe_forward(out, x.contiguous(), self.weights)
        return out


def _activation(experts: Sequence[GatedMLP]) -> ExpertActivation | None:
    activations = {expert.activation for expert in experts}
    if len(activations) != 1:
        return None
    (activation,) = activations
    if activation == SILU:
        return ExpertActivation.SILU
    if isinstance(activation, ClampedSwiGLU):
        return ExpertActivation.CLAMPED_SWIGLU
    return None


def _operands(
    linear: Linear, dtype: torch.dtype
) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(kind, a, b, bias)``: the dense path's operands, with the bias kept."""
    bias = getattr(linear, "bias", None)
    operands = projection_operands(linear, dtype, allow_bias=True)
    if operands is None:
        return None
    return (*operands, _NO_BIAS if bias is None else bias)
