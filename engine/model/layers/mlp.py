"""The feed-forward sublayer: a gated MLP, ``down(act(gate(x)) * up(x))``, with the gate
and up projections fused into one matrix at load. Families whose feed-forward is something
else provide another ``MLP`` (a mixture of experts: layers/moe.py); the decoder only
calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.model.kernels.base import Kernels
from engine.model.layers.linear import Linear

SILU = "silu"
GELU_TANH = "gelu_tanh"
# Hugging Face ``hidden_act`` / ``hidden_activation`` names -> the activations kvserve runs.
_HF_ACTIVATIONS = {
    "silu": SILU,
    "swish": SILU,
    "gelu_pytorch_tanh": GELU_TANH,
    "gelu_tanh": GELU_TANH,
}


class MLP(Protocol):
    """A feed-forward sublayer: ``[tokens, hidden] -> [tokens, hidden]``. Its linear layers
    are reached by ``map_linears`` (quantization) and counted by ``parameter_bytes``; it
    must not modify its input."""

    def __call__(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor: ...


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's activation: the gate clamped above at ``limit``, the up part to
    ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float

    def __call__(self, fused: torch.Tensor) -> torch.Tensor:
        gate, up = fused.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class GatedMLP:
    gate_up: Linear  # [2 * intermediate, hidden]: the gate rows, then the up rows
    down: Linear  # [hidden, intermediate]
    activation: str | ClampedSwiGLU = SILU

    def __call__(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        fused = self.gate_up(x)
        if self.activation == SILU:
            return self.down(kernels.silu_and_mul(fused))
        if self.activation == GELU_TANH:
            return self.down(kernels.gelu_tanh_and_mul(fused))
        assert isinstance(self.activation, ClampedSwiGLU)
        return self.down(self.activation(fused))


def activation_from_config(config: Any) -> str:
    """The gated MLP's activation named by a Hugging Face config; ValueError if kvserve
    has none by that name."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in _HF_ACTIVATIONS:
        raise ValueError(
            f"unsupported MLP activation {name!r}; kvserve runs {sorted(_HF_ACTIVATIONS)}"
        )
    return _HF_ACTIVATIONS[name]
