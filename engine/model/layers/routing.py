"""How a mixture of experts picks a token's experts and weighs them: the families' rules.

- ``SOFTMAX_TOPK`` (Mixtral, Qwen3-MoE): softmax over every expert in float32, the top
  ``k`` probabilities, renormalised to sum to 1 where the family does (Mixtral always,
  Qwen3-MoE with ``norm_topk_prob``);
- ``TOPK_SOFTMAX`` (gpt-oss): the top ``k`` logits (the router has a bias), then a
  softmax over those ``k``.

csrc/moe.cpp computes the same with the same ATen calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
