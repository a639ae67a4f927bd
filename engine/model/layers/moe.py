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

The routing rules are layers/routing.py's.

Experts are visited in ascending id and their outputs added into the token's row in the
model dtype, as transformers' reference does. A one-token decode reads only its ``k``
experts: ``active_decode_bytes`` is what the decode floor counts (``parameter_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.kernels.base import Kernels
from engine.model.layers.linear import DenseLinear, parameter_bytes, rowwise_supported
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.routing import Routing, route
from engine.model.runtime.cpu_moe import NativeMoE

# Steps of at most this many tokens take the native op (runtime/cpu_moe.py) on the native
# kernels. Measured on a 32-expert bf16/int8/int4 layer (2 vCPUs, AVX-512): the op is
# 1.2-4x faster than the loop up to 256 tokens; past ~1,000 the loop's fbgemm int8 GEMMs
# win (the op takes int8 rows four at a time).
NATIVE_MAX_TOKENS = 256


@dataclass
class MoEMLP:
    """A mixture-of-experts ``MLP`` (layers/mlp.py's protocol)."""

    router_weight: torch.Tensor  # [experts, hidden], serving dtype
    router_bias: torch.Tensor | None
    experts: list[GatedMLP]
    routing: Routing
    # Built at the first step on the native kernels: the router as a few-row bf16 or
    # float32 layer where the CPU has the kernel (as a dense bf16 layer or a float32
    # expert would be), and the whole layer as the native op takes it (None where it
    # cannot).
    _router: DenseLinear | None = field(default=None, init=False, repr=False, compare=False)
    _native: NativeMoE | None = field(default=None, init=False, repr=False, compare=False)
    _native_built: bool = field(default=False, init=False, repr=False, compare=False)

    def __call__(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        on_native = kernels.name == "native"
        if on_native and x.shape[0] <= NATIVE_MAX_TOKENS:
            native = self.native_moe(x.dtype)
            if native is not None:
                return native.run(x)
        weights, ids = route(self.router(on_native)(x), self.routing)
        return self.grouped(x, kernels, weights, ids)

    def router(self, on_native: bool) -> DenseLinear:
        """The router's projection (few-row bf16 or float32 on the native kernels where
        supported)."""
        if not on_native:
            return DenseLinear(self.router_weight, self.router_bias)
        if self._router is None:
            rowwise = rowwise_supported(self.router_weight)
            self._router = DenseLinear(self.router_weight, self.router_bias, rowwise=rowwise)
        return self._router

    def native_moe(self, dtype: torch.dtype) -> NativeMoE | None:
        """The layer as the native op runs it, or None where it cannot."""
        if not self._native_built:
            self._native = NativeMoE.build(self.router(True), self.experts, self.routing, dtype)
            self._native_built = True
        return self._native

    def grouped(
        self, x: torch.Tensor, kernels: Kernels, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The step's (token, slot) pairs grouped by expert, each chosen expert run once
        over all of its tokens, outputs added in ascending expert id."""
        top_k = self.routing.top_k
        pairs = ids.flatten()
        order = torch.argsort(pairs, stable=True)
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
