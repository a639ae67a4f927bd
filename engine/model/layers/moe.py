"""Mixture-of-experts feed-forward: a router picks ``top_k`` experts per token, each a
gated MLP, and the token's output is their outputs weighted by the routing weights.

Work is grouped by expert, never by token: the step's (token, expert) pairs are sorted by
expert once, and each expert that any token chose runs its projections once over all of
its tokens (a few-row GEMV in a decode step, a GEMM in a prefill), so a step costs one
pass over the experts it touches, whatever its batch. An expert is a ``GatedMLP`` of
``Linear`` layers, so ``--quantization int8|int4`` reaches every expert the way it
reaches a dense MLP (``map_linears``), and their few-row kernels serve decode steps. The
router stays in the serving dtype (``router_weight`` is a tensor, not a ``Linear``):
rounding it would change which experts a token picks.

The routing rules of the families:

- ``SOFTMAX_TOPK`` (Mixtral, Qwen3-MoE): softmax over every expert in float32, the top
  ``k`` probabilities, renormalised to sum to 1 where the family does (Mixtral always,
  Qwen3-MoE with ``norm_topk_prob``);
- ``TOPK_SOFTMAX`` (gpt-oss): the top ``k`` logits (the router has a bias), then a
  softmax over those ``k``.

Experts are visited in ascending id and their outputs added into the token's row in the
model dtype, as transformers' reference does. A one-token decode reads only its ``k``
experts: ``active_decode_bytes`` is what the decode floor counts (``parameter_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.kernels.base import Kernels
from engine.model.layers.linear import parameter_bytes
from engine.model.layers.mlp import GatedMLP

SOFTMAX_TOPK = "softmax_topk"
TOPK_SOFTMAX = "topk_softmax"


@dataclass(frozen=True)
class Routing:
    """How a token's experts and their weights follow from the router's logits."""

    top_k: int
    rule: str = SOFTMAX_TOPK
    renormalize: bool = True  # SOFTMAX_TOPK only: the top-k weights sum to 1

    def __post_init__(self) -> None:
        if self.rule not in (SOFTMAX_TOPK, TOPK_SOFTMAX):
            raise ValueError(f"unknown routing rule {self.rule!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, not {self.top_k}")


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [tokens, k], expert ids int64 [tokens, k])`` from router logits."""
    if routing.rule == TOPK_SOFTMAX:
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass
class MoEMLP:
    """A mixture-of-experts ``MLP`` (layers/mlp.py's protocol)."""

    router_weight: torch.Tensor  # [experts, hidden], serving dtype
    router_bias: torch.Tensor | None
    experts: list[GatedMLP]
    routing: Routing

    def __call__(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        logits = F.linear(x, self.router_weight, self.router_bias)
        weights, ids = route(logits, self.routing)
        top_k = self.routing.top_k
        pairs = ids.flatten()
        order = torch.argsort(pairs, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        pair_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if not count:
                continue
            chosen = order[start : start + count]
            start += count
            rows = torch.div(chosen, top_k, rounding_mode="floor")
            y = expert(x.index_select(0, rows), kernels)
            y = y * pair_weights.index_select(0, chosen)[:, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def active_decode_bytes(self) -> int:
        """Bytes one token's step reads: the router and ``top_k`` experts (their few-row
        copies), at the experts' mean size."""
        experts = parameter_bytes(self.experts, decode=True)
        router = parameter_bytes([self.router_weight, self.router_bias])
        return router + experts * self.routing.top_k // max(1, len(self.experts))
