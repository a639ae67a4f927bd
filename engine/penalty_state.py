"""Per-request token counts for the penalties, kept on the device between steps.

Presence, frequency and repetition penalties need, for every sampled row, how often each
token id occurs in the request's output and whether it occurs in its prompt. Rebuilding
that from the token lists every step costs O(batch x length) per step, quadratic over a
generation. Instead each request that uses a penalty gets one row of two persistent
``[rows, vocab]`` tensors the first time it samples: output counts (float32) and a
prompt-seen mask (bool). Each later step only adds the output tokens the row has not
consumed yet, in one scatter for the whole batch.

The state follows ``output_token_ids`` as the sampler sees it, by length: a step whose
result was discarded never reached that list, so it is never counted; preemption by
recompute keeps the list, so the counts stay valid; a list that got shorter (a rollback)
rebuilds that row from scratch. ``forget`` frees a request's row for reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_tensor import to_device


@dataclass
class _Slot:
    row: int
    consumed: int  # output tokens already added to the row's counts


class PenaltyState:
    """Output token counts and prompt-seen masks of the live requests that use penalties."""

    def __init__(self, initial_rows: int = 8) -> None:
        self._initial_rows = initial_rows
        self._slots: dict[str, _Slot] = {}
        self._free_rows: list[int] = []
        self._output_counts: torch.Tensor | None = None  # [capacity, vocab] float32
        self._prompt_seen: torch.Tensor | None = None  # [capacity, vocab] bool

    def __len__(self) -> int:
        return len(self._slots)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free_rows.append(slot.row)

    def counts(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output_counts, seen)`` as ``[len(request_ids), vocab]`` tensors, where
        ``seen`` is prompt-seen or output-seen, after syncing each request's row with its
        current output list."""
        self._ensure(vocab, device)
        rows: list[int] = []
        new_rows: list[int] = []
        new_tokens: list[int] = []
        for request_id, prompt, output in zip(request_ids, prompts, outputs, strict=True):
            slot = self._slots.get(request_id)
            if slot is None:
                slot = self._add(request_id, prompt, vocab)
            elif len(output) < slot.consumed:
                self._output_rows()[slot.row].zero_()
                slot.consumed = 0
            fresh = [t for t in output[slot.consumed :] if 0 <= t < vocab]
            new_rows += [slot.row] * len(fresh)
            new_tokens += fresh
            slot.consumed = len(output)
            rows.append(slot.row)
        counts_all = self._output_rows()
        if new_tokens:
            index = (_long(new_rows, device), _long(new_tokens, device))
            ones = torch.ones(len(new_tokens), device=device)
            counts_all.index_put_(index, ones, accumulate=True)
        row_index = _long(rows, device)
        output_counts = counts_all.index_select(0, row_index)
        seen = self._seen_rows().index_select(0, row_index) | (output_counts > 0)
        return output_counts, seen

    # -- rows ------------------------------------------------------------------------------

    def _add(self, request_id: str, prompt: list[int], vocab: int) -> _Slot:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        counts, seen = self._output_rows(), self._seen_rows()
        counts[row].zero_()
        seen[row].zero_()
        ids = [t for t in prompt if 0 <= t < vocab]
        if ids:
            seen[row].index_fill_(0, _long(ids, seen.device), True)
        slot = _Slot(row=row, consumed=0)
        self._slots[request_id] = slot
        return slot

    def _ensure(self, vocab: int, device: torch.device) -> None:
        if self._output_counts is None:
            self._output_counts = torch.zeros(0, vocab, device=device)
            self._prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        assert self._output_counts.shape[1] == vocab, "the vocabulary size changed"

    def _grow(self) -> None:
        counts, seen = self._output_rows(), self._seen_rows()
        old = counts.shape[0]
        extra = max(self._initial_rows, old)  # double: amortised O(1) per request
        self._output_counts = torch.cat([counts, counts.new_zeros(extra, counts.shape[1])])
        self._prompt_seen = torch.cat([seen, seen.new_zeros(extra, seen.shape[1])])
        self._free_rows += range(old + extra - 1, old - 1, -1)

    def _output_rows(self) -> torch.Tensor:
        assert self._output_counts is not None
        return self._output_counts

    def _seen_rows(self) -> torch.Tensor:
        assert self._prompt_seen is not None
        return self._prompt_seen


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, device, torch.long)
