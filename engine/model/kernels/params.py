"""Per-layer attention parameters, as every kernel backend takes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """How one layer's attention turns scores into weights.

    - ``scale`` multiplies ``q . k`` (``head_dim ** -0.5`` unless the family says otherwise).
    - ``window``: key ``k`` is visible to query ``q`` iff ``q - window < k <= q`` (the
      query itself included, as transformers' sliding masks count); None = full causal.
      Blocks wholly before a query's window are never needed: with sliding-window KV groups
      their table entries may be a placeholder block whose contents mean nothing.
    - ``softcap``: scores become ``softcap * tanh(scores / softcap)`` after scaling and
      before masking (Gemma 2).
    - ``sinks``: ``[num_heads]`` float32 logits, one per query head, that join every
      softmax's denominator and take no value (gpt-oss): ``p_k = exp(s_k) / (exp(sink) +
      sum_j exp(s_j))``.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def is_plain_within(self, keys: int) -> bool:
        """Whether a plain scaled causal softmax over at most ``keys`` keys per query
        computes this layer exactly: no soft-cap, no sinks, and no window that could
        hide one of them. Backends whose kernels lack a parameter check this and defer."""
        window_hides_nothing = self.window is None or keys <= self.window
        return self.softcap is None and self.sinks is None and window_hides_nothing

    def kernel_args(self) -> tuple[int, float, torch.Tensor | None]:
        """(window, softcap, sinks) as the native and Triton kernels take them: 0 for no
        window or no cap, sinks as float32."""
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.to(torch.float32)
        return self.window or 0, self.softcap or 0.0, sinks

    @property
    def is_plain(self) -> bool:
        """No window, soft-cap or sinks: plain causal attention at any length."""
        return self.window is None and self.softcap is None and self.sinks is None
