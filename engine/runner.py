"""ModelRunner: owns the weights and the KV pools on one device and executes steps.

One ``execute`` call does, in order: swap-out (device -> host), swap-in (host -> device),
block copies (copy-on-write), then one forward over the flattened new tokens of every
scheduled request, then sampling for the rows whose ``sample`` flag is set. It decides
nothing: every block id comes from the scheduler's ``SchedulerOutput``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from engine.kv.groups import layer_group_indices
from engine.model.kernels.metadata import SequenceChunk, build_grouped_metadata
from engine.model.layers.decoder import DecoderModel
from engine.model.runtime.kv_cache import CopyStaging, KVPool, PagedKVCache, copy_blocks
from engine.model.runtime.memory import measured_memory
from engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from engine.pooling import pool_rows
from engine.prompt_logprobs import score_prompts
from engine.sampler import Sampler, SamplingRow
from engine.speculative.verify import Verified, verify

if TYPE_CHECKING:
    from engine.lora.runtime import LoRARuntime
    from engine.structured import GrammarCompiler, GrammarDecoding


class ModelRunner:
    """Executes ``SchedulerOutput``s against a model and its KV pools."""

    def __init__(
        self,
        model: DecoderModel,
        device_pool: KVPool,
        host_pool: KVPool | None = None,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        grammars: GrammarCompiler | None = None,
        lora: LoRARuntime | None = None,
    ):
        self.model = model
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.cache = PagedKVCache(device_pool, model.dtype)
        shape = device_pool.layout.shape
        self.num_groups = len(shape.groups)
        self.layer_groups = layer_group_indices(shape.groups, shape.num_layers)
        self.staging = CopyStaging(device_pool.layout, device_pool.key.device)
        self.sampler = Sampler(eos_token_ids, seed, greedy=model.kernels.greedy_tokens)
        self.grammar = _grammar_decoding(grammars)
        self.lora = lora  # fills the model's adapter slots for each step (engine/lora/)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def measured_memory(self) -> dict[str, int]:
        """Measured bytes by component (engine/model/runtime/memory.py); safe from any thread."""
        host = self.host_pool.tensors() if self.host_pool is not None else []
        return measured_memory(self.device_pool.key.device, self.device_pool.tensors(), host)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        out = scheduler_output
        self.sampler.forget(out.finished_request_ids)
        if self.grammar is not None:
            self.grammar.forget(out.finished_request_ids)
        self._move_blocks(out)
        if not out.scheduled:
            return RunnerOutput()
        batch = _decodes_first(out.scheduled)
        hidden = self._forward(batch)
        plain = [r for r in batch if r.sample and not r.num_draft_tokens]
        verifying = [r for r in batch if r.num_draft_tokens]
        logits = self._sample_logits(batch, hidden)
        result = self._sample(plain, logits[: len(plain)])
        if verifying:
            _add_verified(result, verify(self.sampler, logits[len(plain) :], verifying))
        if any(r.sampling_params.prompt_logprobs is not None for r in batch):
            result.prompt_logprobs = score_prompts(batch, hidden, self.model.logits)
        if any(r.sampling_params.pooling is not None for r in batch):
            model = self.model
            heads = (model.final_hidden, model.logits, model.classify)
            result.pooled = pool_rows(batch, hidden, *heads)
        return result

    def _move_blocks(self, out: SchedulerOutput) -> None:
        if out.swap_out or out.swap_in:
            if self.host_pool is None:
                raise RuntimeError("the scheduler asked for a swap but there is no host pool")
            copy_blocks(self.device_pool, self.host_pool, out.swap_out, self.staging)
            copy_blocks(self.host_pool, self.device_pool, out.swap_in, self.staging)
        copy_blocks(self.device_pool, self.device_pool, out.copies, self.staging)

    def _forward(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """``_hidden`` with each row's LoRA adapter in place for the forward."""
        if self.lora is None:
            return self._hidden(batch)
        self.lora.prepare(batch, self.model.device)
        try:
            return self._hidden(batch)
        finally:
            self.lora.finish()

    def _hidden(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Final hidden states ``[batch tokens, hidden]`` of the new tokens, in batch order."""
        model = self.model
        by_group = [
            [chunk for r in batch for chunk in chunks(r, group)] for group in range(self.num_groups)
        ]
        meta = build_grouped_metadata(by_group, self.layer_groups, self.block_size, model.device)
        flat_ids = [t for r in batch for t in r.token_ids]
        token_ids = torch.tensor(flat_ids, dtype=torch.long).to(model.device, non_blocking=True)
        return model.forward(token_ids, meta, self.cache)

    def _sample_logits(self, batch: list[ScheduledRequest], hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the rows ``logits_rows`` names."""
        model = self.model
        rows = logits_rows(batch)
        if not rows:
            return hidden.new_empty(0, model.spec.vocab_size, dtype=torch.float32)
        if rows != list(range(hidden.shape[0])):  # not every row, or not in batch order
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        return model.logits(hidden)

    def _sample(self, batch: list[ScheduledRequest], logits: torch.Tensor) -> RunnerOutput:
        """Sample one token for each request of ``batch`` (all sample; one logits row each)."""
        rows = [
            SamplingRow(
                request_id=r.request_id,
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                seed=r.seed,
            )
            for r in batch
        ]
        result = RunnerOutput()
        if not rows:
            return result
        constrained = any(r.params.structured_outputs for r in rows)
        if constrained:
            logits, rows = self._constrain(logits, rows)
        sampled = self.sampler.sample(logits, rows)
        if constrained:
            assert self.grammar is not None
            result.grammar_completed = self.grammar.accept(rows, sampled.token_ids)
        for row, token, logprob in zip(rows, sampled.token_ids, sampled.logprobs, strict=True):
            result.sampled_token_ids[row.request_id] = token
            if logprob is not None:
                result.logprobs[row.request_id] = logprob
        return result

    def _constrain(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, list[SamplingRow]]:
        """Mask what the grammars disallow before anything else (so logprobs are those of
        the constrained distribution) and let the grammar alone decide where a constrained
        output ends: ``min_tokens`` would otherwise mask the only token it allows."""
        if self.grammar is None:
            raise RuntimeError("structured outputs need a runner built with a GrammarCompiler")
        logits = logits.to(torch.float32)
        self.grammar.mask(logits, rows)
        rows = [
            dataclasses.replace(r, params=dataclasses.replace(r.params, min_tokens=0))
            if r.params.structured_outputs and r.params.min_tokens
            else r
            for r in rows
        ]
        return logits, rows


def _add_verified(result: RunnerOutput, verified: dict[str, Verified]) -> None:
    for request_id, outcome in verified.items():
        result.spec_token_ids[request_id] = outcome.token_ids
        if outcome.logprobs is not None:
            result.spec_logprobs[request_id] = outcome.logprobs


def _grammar_decoding(compiler: GrammarCompiler | None) -> GrammarDecoding | None:
    if compiler is None:
        return None
    from engine.structured import GrammarDecoding

    return GrammarDecoding(compiler)


def logits_rows(batch: list[ScheduledRequest]) -> list[int]:
    """The hidden rows that sample, in sampling order: the last row of each plain request
    that samples, then every verified row (the last real token and each draft) of the
    requests that verify drafts, in ``batch`` order within each group."""
    plain_rows: list[int] = []
    verified_rows: list[int] = []
    end = 0
    for request in batch:
        end += request.num_new_tokens
        if request.num_draft_tokens:
            verified_rows += range(end - request.num_draft_tokens - 1, end)
        elif request.sample:
            plain_rows.append(end - 1)
    return plain_rows + verified_rows


def chunks(request: ScheduledRequest, group: int = 0) -> list[SequenceChunk]:
    """The attention's view of a request's new tokens, through KV group ``group``'s block
    table. A verification is one one-token
    decode per position (each attends to the cache up to itself; the K/V of every row is
    written before any row attends): the decode kernel then computes each position exactly
    as plain decoding would, so greedy output is identical in bf16 too, where a prefill
    kernel's different rounding flips near-ties. It reads the context once per position."""
    start, count = request.num_computed_tokens, request.num_new_tokens
    table = request.block_tables[group]
    if request.num_draft_tokens:
        return [SequenceChunk(start + i, 1, table) for i in range(count)]
    return [SequenceChunk(start, count, table)]


def _is_decode(request: ScheduledRequest) -> bool:
    return bool(request.num_draft_tokens) or (
        request.num_new_tokens == 1 and request.num_computed_tokens > 0
    )


def _decodes_first(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The attention metadata wants single-token continuations (verifications included)
    before prefill chunks."""
    # A stable sort on one boolean key: decodes (key False) keep their order, then the rest.
    return sorted(scheduled, key=lambda r: not _is_decode(r))
