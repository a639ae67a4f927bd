"""Scores and reranking (vLLM's /v1/score and /v1/rerank, Jina / Cohere-like shapes) from
one of two kinds of model, each (query, document) pair one prefill-only engine request
that runs beside generation like embeddings (server/embeddings.py ``run_pooled``):

- a cross-encoder, a decoder ``*ForSequenceClassification`` checkpoint: its classifier
  head's logit on ``tokenizer(query, document)``, through a sigmoid
  (server/cross_encoder.py); no flag needed;
- a causal reranker (``--reranker``): the probability of "yes" against "no" as the
  model's next token after its judging prompt (Qwen3-Reranker's definition: softmax over
  the two logits at the prompt's last position, ``PoolingParams("last", token_ids=(yes,
  no))``).

Encoder cross-encoders (BERT, XLM-R: bge-reranker-v2-m3, ms-marco MiniLM) are not
served: kvserve runs decoder-only models. A causal LM without ``--reranker`` answers 400
naming the ways to score.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, model_validator

from engine.request import PoolingParams
from server.cross_encoder import check_cross_encoder, prepare_text_pairs
from server.embeddings import MAX_INPUTS, run_pooled, truncate
from server.errors import invalid
from server.protocol import StrictModel
from server.routes.context import ServingContext
from server.text_tokens import encode_text


@dataclass(frozen=True)
class RerankerFormat:
    """A causal reranker's prompt around ``instruction``, query and document, and the
    tokens whose logits judge it."""

    prefix: str
    body: str  # with {instruction}, {query}, {document}
    suffix: str
    instruction: str
    yes: str
    no: str


# Qwen3-Reranker's model card.
QWEN3 = RerankerFormat(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
    ),
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query",
    yes="yes",
    no="no",
)
RERANKER_FORMATS = {"qwen3": QWEN3}


class _ScoringFields(StrictModel):
    TURN_LIST_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # The reranker's task description (its default when left out).
    instruction: str | None = None
    user: str | None = None


class ScoreRequest(_ScoringFields):
    """vLLM's /v1/score: ``text_1`` against ``text_2``, one to one, one to many, or many
    to many (lists of one length)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_ScoringFields):
    """vLLM's /v1/rerank: ``documents`` ordered by relevance to ``query``; ``top_n`` of
    them (0: all)."""

    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True


# Blocking: (ctx, pairs, truncate_prompt_tokens, param) -> each pair's prompt ids.
PreparePairs = Callable[[ServingContext, list[tuple[str, str]], int | None, str], list[list[int]]]


@dataclass(frozen=True)
class Scorer:
    """How the served model scores: each pair's prompt (``prepare``, off the event
    loop), the engine's pooling of it, and the score of the pooled vector."""

    prepare: PreparePairs
    pooling: PoolingParams
    score: Callable[[list[float]], float]


def scorer(ctx: ServingContext, instruction: str | None) -> Scorer:
    """The served model's scorer: its classifier head, else ``--reranker``'s format;
    400 when it has neither or the request does not fit it."""
    if ctx.num_labels:
        activation = check_cross_encoder(ctx, instruction)
        return Scorer(
            prepare_text_pairs, PoolingParams("last", classify=True), lambda v: activation(v[0])
        )
    fmt, ids = reranker(ctx)

    def prepare(
        ctx: ServingContext, pairs: list[tuple[str, str]], keep: int | None, param: str
    ) -> list[list[int]]:
        return prepare_pairs(ctx, fmt, pairs, instruction, keep, param)

    return Scorer(prepare, PoolingParams("last", token_ids=ids), relevance)


def reranker(ctx: ServingContext) -> tuple[RerankerFormat, tuple[int, int]]:
    """The server's reranker format and its (yes, no) token ids; 400 without one."""
    name = ctx.settings.reranker
    if name is None:
        raise invalid(
            "this server has no scoring model: kvserve scores with a cross-encoder (serve a "
            "*ForSequenceClassification checkpoint of a decoder family, e.g. "
            "Qwen3ForSequenceClassification) or with a causal reranker's yes/no logits "
            "(start it with --reranker qwen3 and a Qwen3-Reranker model)",
            code="model_not_supported",
        )
    fmt = RERANKER_FORMATS[name]
    ids = (_single_token(ctx, fmt.yes), _single_token(ctx, fmt.no))
    return fmt, ids


def _single_token(ctx: ServingContext, token: str) -> int:
    tokenizer = ctx.tokenizer
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise invalid(
            f"the model's tokenizer has no single '{token}' token, so it cannot be the "
            "reranker --reranker names",
            code="model_not_supported",
        )
    return int(token_id)


def pairs_of(body: ScoreRequest) -> list[tuple[str, str]]:
    """vLLM's pairing rules for text_1 x text_2."""
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first or not second:
        raise invalid(
            "'text_1' and 'text_2' must not be empty", "text_1" if not first else "text_2"
        )
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise invalid(
            "'text_1' must be one text or as many texts as 'text_2' "
            f"({len(first)} and {len(second)})",
            "text_1",
        )
    return list(zip(first, second, strict=True))


def prepare_pairs(
    ctx: ServingContext,
    fmt: RerankerFormat,
    pairs: list[tuple[str, str]],
    instruction: str | None,
    keep: int | None,
    param: str,
) -> list[list[int]]:
    """Each (query, document) in the reranker's prompt, tokenized as its model card does
    (prefix, body and suffix each on their own, no special tokens added). Blocking."""
    if len(pairs) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} pairs per request", param)
    tokenizer = ctx.tokenizer
    prefix = encode_text(tokenizer, fmt.prefix, add_special_tokens=False)
    suffix = encode_text(tokenizer, fmt.suffix, add_special_tokens=False)
    task = fmt.instruction if instruction is None else instruction
    prompts = []
    for query, document in pairs:
        text = fmt.body.format(instruction=task, query=query, document=document)
        ids = prefix + encode_text(tokenizer, text, add_special_tokens=False) + suffix
        prompts.append(truncate(ctx, ids, keep, param))
    return prompts


def relevance(yes_no: list[float]) -> float:
    """P(yes) under a softmax over the (yes, no) logits."""
    yes, no = yes_no
    return 1.0 / (1.0 + math.exp(no - yes))


async def score_prompts(
    ctx: ServingContext, scoring: Scorer, prompts: list[list[int]], endpoint: str
) -> list[float]:
    start = time.monotonic()
    pooled = await run_pooled(ctx, prompts, scoring.pooling, endpoint)
    if ctx.metrics is not None:
        tokens = sum(len(p) for p in prompts)
        ctx.metrics.observe_pooling(endpoint, len(prompts), tokens, time.monotonic() - start)
    return [scoring.score(vector) for vector in pooled]


def score_body(ctx: ServingContext, scores: list[float], num_tokens: int) -> dict[str, Any]:
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": [
            {"index": index, "object": "score", "score": score}
            for index, score in enumerate(scores)
        ],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def rerank_body(
    ctx: ServingContext, body: RerankRequest, scores: list[float], num_tokens: int
) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": ctx.model_name,
        "results": results,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
