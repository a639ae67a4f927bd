"""Constrained decoding through the real scheduler and runner: a tiny random Llama with
SmolLM2's vocabulary and real tokenizer. Random weights are the point: only the grammar
mask can make their output parse.

Slow only because SmolLM2's tokenizer takes a while to read from the GGUF."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import jsonschema
import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.errors import GrammarError
from engine.model.layers.decoder import DecoderModel
from engine.model.layers.quantize import quantize_weights
from engine.model.loader import model_from_reference
from engine.outputs import RequestDelta, SchedulerOutput
from engine.request import FinishReason, Request, SamplingParams, StructuredOutputs
from engine.sampler import SamplingRow
from engine.structured import GrammarCompiler, GrammarDecoding
from engine.structured import decoding as decoding_module
from tests.model.engine_helpers import make_core

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "verified": {"type": "boolean"},
            },
            "required": ["city", "verified"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "owner", "tags"],
}
JSON_SCHEMA = StructuredOutputs("json_schema", json.dumps(SCHEMA))
PROMPTS = {
    "p0": [5, 9, 17, 33, 65, 129, 7, 3, 2, 1, 99, 100, 101],
    "p1": [11, 12],
    "p2": [200, 150, 100, 50, 25, 12, 6, 3],
    "p3": [42] * 21,
}


@pytest.fixture(scope="module")
def eos(smollm_tokenizer: Any) -> tuple[int, ...]:
    return (int(smollm_tokenizer.eos_token_id),)


@pytest.fixture(scope="module")
def tiny(tiny_llama_factory: Any, smollm_tokenizer: Any) -> DecoderModel:
    _, reference = tiny_llama_factory(vocab_size=len(smollm_tokenizer), tie_embeddings=True)
    return model_from_reference(reference)


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer: Any, tiny: DecoderModel, eos: tuple[int, ...]) -> GrammarCompiler:
    return GrammarCompiler(smollm_tokenizer, tiny.spec.vocab_size, eos)


def core_for(
    model: DecoderModel,
    compiler: GrammarCompiler,
    eos: tuple[int, ...],
    cache: CacheConfig | None = None,
    scheduler: SchedulerConfig | None = None,
) -> EngineCore:
    cache = cache or CacheConfig(num_device_blocks=512, block_size=4)
    return make_core(model, cache, scheduler, eos_token_ids=eos, grammars=compiler)


def constrained(spec: StructuredOutputs, max_tokens: int = 96, **extra: Any) -> SamplingParams:
    extra.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **extra)


def run(
    core: EngineCore,
    prompts: dict[str, list[int]],
    params: dict[str, SamplingParams] | SamplingParams,
    eos: tuple[int, ...],
) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Every request's (output ids, finish reason); ``n > 1`` choices as ``rid#index``."""
    deltas: list[RequestDelta] = []
    for rid, prompt in prompts.items():
        p = params if isinstance(params, SamplingParams) else params[rid]
        group = [Request(rid, list(prompt), p, eos_token_ids=eos)]
        group += [
            Request(f"{rid}#{i}", list(prompt), p, eos_token_ids=eos, group_id=rid, index=i)
            for i in range(1, p.n)
        ]
        core.add_request(group)
    for _ in range(5_000):
        if not core.has_unfinished():
            break
        deltas += core.step()
        core.scheduler.check_integrity()
    assert not core.has_unfinished()
    out: dict[str, tuple[list[int], FinishReason | None]] = {}
    for delta in deltas:
        assert delta.error is None, delta.error
        ids, _ = out.get(delta.request_id, ([], None))
        out[delta.request_id] = (ids + delta.new_token_ids, delta.finish_reason)
    return out


def text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


# -- what the output looks like --------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(
    tiny, compiler, eos, smollm_tokenizer, temperature
):
    core = core_for(tiny, compiler, eos)
    params = constrained(JSON_SCHEMA, max_tokens=160, temperature=temperature, seed=7)
    for ids, finish in run(core, PROMPTS, params, eos).values():
        assert finish is FinishReason.STOP
        jsonschema.validate(json.loads(text(smollm_tokenizer, ids)), SCHEMA)


def test_json_object_is_an_object(tiny, compiler, eos, smollm_tokenizer):
    # Random weights would ramble inside a key forever; biased towards '{' and '}' they
    # close the object as soon as the grammar allows, wherever the bias would rather not.
    bias = tuple((smollm_tokenizer.convert_tokens_to_ids(t), 30.0) for t in ("{", "}", "["))
    params = constrained(StructuredOutputs("json_object"), logit_bias=bias)
    for ids, finish in run(core_for(tiny, compiler, eos), PROMPTS, params, eos).values():
        assert finish is FinishReason.STOP
        assert json.loads(text(smollm_tokenizer, ids)) == {}


def test_regex(tiny, compiler, eos, smollm_tokenizer):
    pattern = r"[A-Z]{2}-\d{3}(-[a-z]{1,4})?"
    params = constrained(StructuredOutputs("regex", pattern), temperature=1.0, seed=3)
    for ids, finish in run(core_for(tiny, compiler, eos), PROMPTS, params, eos).values():
        assert finish is FinishReason.STOP
        assert re.fullmatch(pattern, text(smollm_tokenizer, ids))


def test_choice_with_quotes_backslashes_and_unicode(tiny, compiler, eos, smollm_tokenizer):
    options = ['say "yes"', "back\\slash", "naïve", "a|b", "no"]
    params = constrained(StructuredOutputs.choice(options), temperature=1.0, seed=11)
    outputs = run(core_for(tiny, compiler, eos), PROMPTS, params, eos)
    for ids, finish in outputs.values():
        assert finish is FinishReason.STOP
        assert text(smollm_tokenizer, ids) in options


def test_ebnf_grammar(tiny, compiler, eos, smollm_tokenizer):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]?'
    params = constrained(StructuredOutputs("grammar", grammar), temperature=1.0, seed=5)
    for ids, finish in run(core_for(tiny, compiler, eos), PROMPTS, params, eos).values():
        assert finish is FinishReason.STOP
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)", text(smollm_tokenizer, ids))


def test_max_tokens_cuts_the_output_at_length(tiny, compiler, eos, smollm_tokenizer):
    outputs = run(core_for(tiny, compiler, eos), PROMPTS, constrained(JSON_SCHEMA, 5), eos)
    for ids, finish in outputs.values():
        assert finish is FinishReason.LENGTH and len(ids) == 5
        start, prefix = text(smollm_tokenizer, ids), '{"name": "'
        assert start.startswith(prefix) or prefix.startswith(start)  # truncated JSON


def test_completed_grammar_stops_despite_ignore_eos_and_min_tokens(
    tiny, compiler, eos, smollm_tokenizer
):
    spec = StructuredOutputs.choice(["yes", "no"])
    params = constrained(spec, max_tokens=50, ignore_eos=True, min_tokens=20)
    outputs = run(core_for(tiny, compiler, eos), PROMPTS, params, eos)
    for ids, finish in outputs.values():
        assert finish is FinishReason.STOP
        assert text(smollm_tokenizer, ids) in ("yes", "no") and not set(ids) & set(eos)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(tiny, compiler, eos):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = run(core_for(tiny, compiler, eos), {"p1": PROMPTS["p1"]}, plain, eos)
    mixed_params = {rid: constrained(JSON_SCHEMA) for rid in PROMPTS} | {"p1": plain}
    mixed = run(core_for(tiny, compiler, eos), PROMPTS, mixed_params, eos)
    assert mixed["p1"] == alone["p1"]


def test_logprobs_are_of_the_constrained_distribution(tiny, compiler, eos, smollm_tokenizer):
    params = constrained(StructuredOutputs.choice(["yes", "no"]), logprobs=20)
    core = core_for(tiny, compiler, eos)
    core.add_request([Request("r", PROMPTS["p0"], params, eos_token_ids=eos)])
    first = core.step()[0].logprobs
    assert first is not None
    (sampled,) = first
    allowed = [(t, lp) for t, lp in sampled.top if lp > float("-inf")]
    # Only prefixes of "yes" and "no" are possible, and their probabilities sum to one.
    for token, _ in allowed:
        piece = smollm_tokenizer.decode([token])
        assert "yes".startswith(piece) or "no".startswith(piece), piece
    assert sum(torch.tensor([lp for _, lp in allowed]).exp().tolist()) == pytest.approx(1, 1e-4)
    assert sampled.logprob == max(lp for _, lp in allowed)


# -- the same greedy output under every engine condition -------------------------------------


@pytest.fixture(scope="module")
def baseline(tiny, compiler, eos) -> dict[str, tuple[list[int], FinishReason | None]]:
    return run(core_for(tiny, compiler, eos), PROMPTS, constrained(JSON_SCHEMA), eos)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_survives_preemption(tiny, compiler, eos, baseline, mode):
    scheduler = SchedulerConfig(max_model_len=128, preemption_mode=mode, swap_min_tokens=1)
    cache = CacheConfig(num_device_blocks=32, block_size=4, num_host_blocks=256, watermark=0.0)
    core = core_for(tiny, compiler, eos, cache, scheduler)
    outputs = run(core, PROMPTS, constrained(JSON_SCHEMA), eos)
    stats = core.stats()
    assert stats.preemptions_total.get(mode, 0) > 0, stats.preemptions_total
    assert outputs == baseline


@pytest.mark.parametrize("budget", [3, 8])
def test_greedy_output_with_chunked_prefill(tiny, compiler, eos, baseline, budget):
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=128)
    core = core_for(tiny, compiler, eos, scheduler=scheduler)
    assert run(core, PROMPTS, constrained(JSON_SCHEMA), eos) == baseline


def test_greedy_output_with_prefix_cache_hits(tiny, compiler, eos, baseline):
    core = core_for(tiny, compiler, eos)
    run(core, {"p0": PROMPTS["p0"]}, constrained(JSON_SCHEMA), eos)
    outputs = run(core, {"p0": PROMPTS["p0"], "p3": PROMPTS["p3"]}, constrained(JSON_SCHEMA), eos)
    assert core.stats().prefix_cache_hits_total > 0
    assert outputs == {"p0": baseline["p0"], "p3": baseline["p3"]}


def test_greedy_choices_of_n_each_follow_their_own_grammar(tiny, compiler, eos, baseline):
    outputs = run(core_for(tiny, compiler, eos), PROMPTS, constrained(JSON_SCHEMA, n=3), eos)
    for rid in PROMPTS:
        assert outputs[rid] == outputs[f"{rid}#1"] == outputs[f"{rid}#2"] == baseline[rid]


def test_sampled_choices_of_n_are_each_valid(tiny, compiler, eos, smollm_tokenizer):
    params = constrained(JSON_SCHEMA, max_tokens=160, n=4, temperature=1.0, seed=1)
    outputs = run(core_for(tiny, compiler, eos), {"p0": PROMPTS["p0"]}, params, eos)
    assert len(outputs) == 4
    for ids, finish in outputs.values():
        assert finish is FinishReason.STOP
        jsonschema.validate(json.loads(text(smollm_tokenizer, ids)), SCHEMA)
    assert len({tuple(ids) for ids, _ in outputs.values()}) > 1  # seeds per choice differ


class RepeatingRunner:
    """Runs every batch twice and keeps only the second result: what the step executor
    does when it retries a batch after an out-of-memory error."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.repeats = 0

    def execute(self, out: SchedulerOutput) -> Any:
        if out.scheduled:
            self.runner.execute(out)
            self.repeats += 1
        return self.runner.execute(out)


def test_greedy_output_survives_discarded_step_results(tiny, compiler, eos, baseline):
    core = core_for(tiny, compiler, eos)
    repeating = RepeatingRunner(core.runner)
    core.runner = repeating
    assert run(core, PROMPTS, constrained(JSON_SCHEMA), eos) == baseline
    assert repeating.repeats > 10


def test_seeded_sampling_with_penalties_and_truncation_is_valid_and_reproducible(
    tiny, compiler, eos, smollm_tokenizer
):
    params = constrained(
        JSON_SCHEMA,
        max_tokens=160,
        temperature=0.9,
        top_k=40,
        top_p=0.9,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        seed=123,
    )
    first = run(core_for(tiny, compiler, eos), PROMPTS, params, eos)
    again = run(core_for(tiny, compiler, eos), PROMPTS, params, eos)
    assert first == again
    for ids, finish in first.values():
        assert finish is FinishReason.STOP
        jsonschema.validate(json.loads(text(smollm_tokenizer, ids)), SCHEMA)


def test_int8_weights_greedy_is_reproducible_and_valid_under_preemption(
    tiny, compiler, eos, smollm_tokenizer
):
    """int8 activation scales are per step, so tokens depend on what shares a step (see
    test_weight_quant): the same batches give the same tokens, and any batching parses."""
    int8 = tiny.replace(weights=quantize_weights(tiny.weights, "int8"))
    runs = [
        run(core_for(int8, compiler, eos), PROMPTS, constrained(JSON_SCHEMA), eos) for _ in "ab"
    ]
    assert runs[0] == runs[1]
    scheduler = SchedulerConfig(max_model_len=128, preemption_mode="recompute")
    cache = CacheConfig(num_device_blocks=32, block_size=4, watermark=0.0)
    core = core_for(int8, compiler, eos, cache, scheduler)
    preempted = run(core, PROMPTS, constrained(JSON_SCHEMA), eos)
    assert sum(core.stats().preemptions_total.values()) > 0
    for ids, finish in [*runs[0].values(), *preempted.values()]:
        assert finish is FinishReason.STOP
        jsonschema.validate(json.loads(text(smollm_tokenizer, ids)), SCHEMA)


def test_grammar_state_is_dropped_when_requests_finish(tiny, compiler, eos):
    core = core_for(tiny, compiler, eos)
    run(core, PROMPTS, constrained(JSON_SCHEMA), eos)
    core.step()  # the step after the last finish carries finished_request_ids
    grammar = core.runner.grammar  # type: ignore[attr-defined]
    assert grammar.num_sequences == 0


def test_a_runner_without_a_compiler_fails_constrained_requests(tiny, eos):
    core = make_core(tiny, CacheConfig(num_device_blocks=64, block_size=4), eos_token_ids=eos)
    core.add_request([Request("r", [1, 2, 3], constrained(JSON_SCHEMA), eos_token_ids=eos)])
    (delta,) = core.step()
    assert delta.finish_reason is FinishReason.ABORT and "GrammarCompiler" in (delta.error or "")


# -- the mask: one op for the batch ------------------------------------------------------------


def test_one_mask_op_per_step_for_eight_constrained_rows(tiny, compiler, eos, monkeypatch):
    calls: list[int] = []
    real_apply = decoding_module.apply_bitmask

    def counting_apply(
        logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], masks: list[int], vocab: int
    ) -> None:
        calls.append(len(rows))
        real_apply(logits, bitmask, rows, masks, vocab)

    monkeypatch.setattr(decoding_module, "apply_bitmask", counting_apply)
    core = core_for(tiny, compiler, eos)
    for i in range(8):
        params = constrained(JSON_SCHEMA, max_tokens=8, ignore_eos=True)
        core.add_request([Request(f"c{i}", [3 + i, 4, 5], params, eos_token_ids=eos)])
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    core.add_request([Request("u", [9, 9, 9], plain, eos_token_ids=eos)])
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
    assert calls == [8] * steps


def rows_for(specs: list[StructuredOutputs | None]) -> list[SamplingRow]:
    return [
        SamplingRow(f"r{i}", SamplingParams(structured_outputs=spec), [], [])
        for i, spec in enumerate(specs)
    ]


def test_mask_touches_only_constrained_rows_and_leaves_the_allowed_logits(
    compiler, smollm_tokenizer
):
    decoding = GrammarDecoding(compiler)
    choice = StructuredOutputs.choice(["yes", "no"])
    rows = rows_for([None, choice, None, JSON_SCHEMA])
    logits = torch.randn(4, compiler.vocab_size)
    original = logits.clone()
    assert decoding.mask(logits, rows) == 2
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(
        "yes".startswith(smollm_tokenizer.decode([t]))
        or "no".startswith(smollm_tokenizer.decode([t]))
        for t in allowed
    )
    assert torch.equal(logits[1, allowed], original[1, allowed])
    json_allowed = torch.isfinite(logits[3]).nonzero().flatten().tolist()
    assert all(smollm_tokenizer.decode([t]).lstrip().startswith("{") for t in json_allowed)


def allowed_after(compiler: GrammarCompiler, spec: StructuredOutputs, history: list[int]) -> Any:
    """The tokens a fresh matcher allows after ``history``: the mask a fill in the step
    would give."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile(spec).grammar)
    for token in history:
        assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return torch.isfinite(logits[0])


def test_masks_filled_ahead_are_used_only_for_the_history_they_were_filled_for(compiler):
    decoding = GrammarDecoding(compiler)
    rows = rows_for([JSON_SCHEMA, None, JSON_SCHEMA])
    generator = torch.Generator().manual_seed(0)

    def step() -> list[int]:
        logits = torch.randn(3, compiler.vocab_size, generator=generator)
        decoding.mask(logits, rows)
        for i in (0, 2):
            assert torch.equal(
                torch.isfinite(logits[i]),
                allowed_after(compiler, JSON_SCHEMA, rows[i].output_token_ids),
            )
        tokens = logits.argmax(-1).tolist()
        decoding.accept(rows, tokens)  # starts filling the next masks on the worker
        for row, token in zip(rows, tokens, strict=True):
            row.output_token_ids.append(token)
        return tokens

    for _ in range(4):
        step()
    assert decoding.rows_filled_late == 2, "only the first step fills in the step"
    assert decoding.rows_filled_ahead == 2 * 3

    # Row 0 is recomputed from two tokens back (a preemption): its mask filled ahead
    # belongs to a history it no longer has, so it is filled again in the step.
    del rows[0].output_token_ids[-2:]
    step()
    assert decoding.rows_filled_late == 3 and decoding.rows_filled_ahead == 2 * 3 + 1

    decoding.forget(["r0", "r2"])
    assert decoding.num_sequences == 0


def test_a_batch_without_grammars_does_no_mask_work(compiler, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(decoding_module, "apply_bitmask", lambda *a, **k: calls.append(1))
    decoding = GrammarDecoding(compiler)
    logits = torch.randn(3, compiler.vocab_size)
    assert decoding.mask(logits, rows_for([None, None, None])) == 0
    assert calls == [] and decoding.num_sequences == 0


# -- compiling ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs("json_schema", '{"type": "objectx"}'), 'Unsupported type "objectx"'),
        (StructuredOutputs("json_schema", '{"type": "object",'), "not valid JSON"),
        (
            StructuredOutputs("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
            "minimum greater than maximum",
        ),
        (StructuredOutputs("regex", "[a-"), "Unclosed '['"),
        (StructuredOutputs("grammar", "root ::= item"), 'Rule "item" is not defined'),
        (StructuredOutputs("choice", "[]"), "non-empty list of strings"),
        (StructuredOutputs("choice", "[1, 2]"), "only strings"),
    ],
)
def test_bad_specs_raise_grammar_error_saying_what_is_wrong(compiler, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)) as caught:
        compiler.compile(spec)
    assert "/project/cpp" not in str(caught.value)


def test_compiled_grammars_are_cached_by_spec(smollm_tokenizer, tiny, eos):
    compiler = GrammarCompiler(smollm_tokenizer, tiny.spec.vocab_size, eos, max_cached=2)
    first = compiler.compile(JSON_SCHEMA)
    assert compiler.compile(StructuredOutputs("json_schema", json.dumps(SCHEMA))) is first
    assert compiler.num_compiled == 1
    compiler.compile(StructuredOutputs("regex", "a+"))
    compiler.compile(StructuredOutputs("regex", "b+"))  # evicts the least recently used
    assert not compiler.cached(JSON_SCHEMA) and compiler.num_compiled == 3


def test_a_burst_of_identical_specs_compiles_once(smollm_tokenizer, tiny, eos):
    compiler = GrammarCompiler(smollm_tokenizer, tiny.spec.vocab_size, eos)
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def compile_one() -> None:
        barrier.wait()
        results.append(compiler.compile(JSON_SCHEMA))

    threads = [threading.Thread(target=compile_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert compiler.num_compiled == 1


def test_failed_compiles_are_not_cached_and_raise_for_every_waiter(compiler):
    bad = StructuredOutputs("regex", "(unclosed")
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile(bad)
    assert not compiler.cached(bad)


def test_a_constraint_with_after_waits_for_those_tokens(compiler, smollm_tokenizer):
    """``StructuredOutputs.after`` (a thinking model's end of reasoning): the row is free
    until the marker tokens are in the output, then the grammar governs what follows them
    (and is found again when a rollback took the marker away)."""
    marker = tuple(smollm_tokenizer.encode("</think>", add_special_tokens=False))
    choice = StructuredOutputs("choice", json.dumps(["yes", "no"]), after=marker)
    decoding = GrammarDecoding(compiler)
    (row,) = rows_for([choice])
    generator = torch.Generator().manual_seed(1)

    def step(token: int | None = None) -> torch.Tensor:
        logits = torch.randn(1, compiler.vocab_size, generator=generator)
        original = logits.clone()
        decoding.mask(logits, [row])
        chosen = int(logits.argmax()) if token is None else token
        decoding.accept([row], [chosen])
        row.output_token_ids.append(chosen)
        return torch.equal(logits, original)

    free = smollm_tokenizer.encode("Some reasoning here", add_special_tokens=False)
    for token in free:  # reasoning: nothing masked, whatever the tokens
        assert step(token)
    for token in marker:
        assert step(token)
    assert not step()  # the grammar now masks the first answer token
    answer = smollm_tokenizer.decode(row.output_token_ids[len(free) + len(marker) :])
    assert "yes".startswith(answer) or "no".startswith(answer)
    del row.output_token_ids[len(free) :]  # a rollback to before the marker
    assert step(free[0])
    assert choice.grammar_spec == StructuredOutputs("choice", json.dumps(["yes", "no"]))
    assert choice.grammar_start(row.output_token_ids) is None


def test_an_opener_lets_the_first_token_open_a_think_block_or_start_the_grammar(
    compiler, smollm_tokenizer
):
    """``StructuredOutputs.opener`` (a model that chooses whether to think): the first
    token may be the grammar's or the opener. Opening defers the grammar to the end
    marker; any other first token is already the grammar's."""
    marker = tuple(smollm_tokenizer.encode("</think>", add_special_tokens=False))
    opener = smollm_tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]  # one token
    options = json.dumps(["yes", "no"])
    spec = StructuredOutputs("choice", options, after=marker, opener=opener)
    assert spec.grammar_spec == StructuredOutputs("choice", options)
    generator = torch.Generator().manual_seed(3)

    def run(first_choice: str) -> list[int]:
        decoding = GrammarDecoding(compiler)
        (row,) = rows_for([spec])
        for index in range(40):
            logits = torch.randn(1, compiler.vocab_size, generator=generator)
            if index == 0:  # make the wanted first choice the likeliest
                logits[0, opener] = 50.0 if first_choice == "open" else -50.0
            decoding.mask(logits, [row])
            if index == 0:
                allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
                assert opener in allowed and len(allowed) > 1  # the grammar's and the opener
            token = int(logits.argmax())
            if first_choice == "open" and 1 <= index <= len(marker) + 2:
                reasoning = smollm_tokenizer.encode("ok", add_special_tokens=False)
                script = [*reasoning, *marker]
                token = script[index - 1] if index - 1 < len(script) else token
            completed = decoding.accept([row], [token])
            row.output_token_ids.append(token)
            if completed:
                break
        return row.output_token_ids

    opened = run("open")
    assert opened[0] == opener
    answer_from = opened.index(marker[-1]) + 1
    answer = smollm_tokenizer.decode(opened[answer_from:])
    assert answer in ("yes", "no"), answer
    direct = run("answer")
    assert direct[0] != opener
    assert smollm_tokenizer.decode(direct) in ("yes", "no")
    with pytest.raises(ValueError, match="opener needs"):
        StructuredOutputs("choice", options, opener=opener)
