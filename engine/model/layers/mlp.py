"""The feed-forward sublayer: a gated MLP, ``down(act(gate(x)) * up(x))``, with the gate
and up projections fused into one matrix at load. Families whose feed-forward is something
else (mixture-of-experts) provide another ``MLP``; the decoder only calls it."""

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


@dataclass
class GatedMLP:
    gate_up: Linear  # [2 * intermediate, hidden]: the gate rows, then the up rows
    down: Linear  # [hidden, intermediate]
    activation: str = SILU

    def __call__(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        fused = self.gate_up(x)
        if self.activation == SILU:
            return self.down(kernels.silu_and_mul(fused))
        return self.down(kernels.gelu_tanh_and_mul(fused))


def activation_from_config(config: Any) -> str:
    """The gated MLP's activation named by a Hugging Face config; ValueError if kvserve
    has none by that name."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in _HF_ACTIVATIONS:
        raise ValueError(
            f"unsupported MLP activation {name!r}; kvserve runs {sorted(_HF_ACTIVATIONS)}"
        )
    return _HF_ACTIVATIONS[name]
