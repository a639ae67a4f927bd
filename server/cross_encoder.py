"""Scores from a cross-encoder: a decoder ``*ForSequenceClassification`` checkpoint
(Llama, Qwen2/3, Mistral, Gemma, ... with a ``score`` head instead of an LM head) served
as it is, without ``--reranker``.

Each (query, document) is tokenized as a text pair, ``tokenizer(query, document)``, as
sentence-transformers' CrossEncoder and vLLM do; the engine returns the head's logits at
the last prompt position (``PoolingParams("last", classify=True)``); the score is the
logit through the activation the model directory names (sentence-transformers'
``activation_fn`` in config.json: Sigmoid or Identity), else a sigmoid, as both of them
do for one label. A head of several labels gives no single relevance: 400, as vLLM's
score API refuses one (server/scoring.py builds the routes' scorer from this module).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.pooling_config import ModelPooling
from server.embeddings import MAX_INPUTS, truncate
from server.errors import invalid
from server.text_tokens import encode_text

if TYPE_CHECKING:
    from server.routes.context import ServingContext


def sigmoid(logit: float) -> float:
    """1 / (1 + e^-x) without overflow for logits of either sign."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    exp = math.exp(logit)
    return exp / (1.0 + exp)


def identity(logit: float) -> float:
    return logit


# The activations sentence-transformers writes, as torch.nn.modules qualnames.
ACTIVATIONS: dict[str, Callable[[float], float]] = {
    "torch.nn.modules.activation.Sigmoid": sigmoid,
    "torch.nn.modules.linear.Identity": identity,
}


def score_function(pooling: ModelPooling) -> Callable[[float], float]:
    """The activation of the model's one logit: the one its config.json names, else a
    sigmoid. ValueError for one kvserve does not apply (refused at startup)."""
    name = pooling.score_activation
    if name is None:
        return sigmoid
    if name not in ACTIVATIONS:
        raise ValueError(
            f"the model's config.json names the cross-encoder activation {name!r}; kvserve "
            f"applies {' or '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


def check_classifier_settings(num_labels: int, pooling: ModelPooling, reranker: str | None) -> None:
    """Startup: a classifier model scores with its own head, so ``--reranker`` (a causal
    reranker's prompt format) contradicts it; its activation must be one kvserve applies.
    ValueError saying what to change."""
    if not num_labels:
        return
    if reranker is not None:
        raise ValueError(
            f"--reranker {reranker} names a causal reranker's prompt format, but this model "
            "is a sequence classifier (a *ForSequenceClassification checkpoint) that scores "
            "with its own head: leave --reranker out"
        )
    score_function(pooling)


def check_cross_encoder(ctx: ServingContext, instruction: str | None) -> Callable[[float], float]:
    """400 unless the served classifier can score pairs (one logit) and the request fits
    it; the function from its logit to the score."""
    if ctx.num_labels != 1:
        raise invalid(
            f"this model's classifier head gives {ctx.num_labels} logits per input; "
            "/v1/score and /v1/rerank need a cross-encoder with one relevance logit "
            "(num_labels 1)",
            code="model_not_supported",
        )
    if instruction is not None:
        raise invalid(
            "'instruction' is a causal reranker's task description (--reranker); this "
            "cross-encoder scores the (query, document) pair as it is: leave it out",
            "instruction",
        )
    return score_function(ctx.model_pooling)


def prepare_text_pairs(
    ctx: ServingContext, pairs: list[tuple[str, str]], keep: int | None, param: str
) -> list[list[int]]:
    """Each (query, document) as ``tokenizer(query, document)``'s ids (the tokenizer's
    special tokens and pair separator included), truncated as the embeddings route
    truncates. Blocking (tokenizes)."""
    if len(pairs) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} pairs per request", param)
    prompts = []
    for query, document in pairs:
        ids = encode_text(ctx.tokenizer, query, pair=document, add_special_tokens=True)
        if not ids:
            raise invalid("a (query, document) pair has no tokens", param)
        prompts.append(truncate(ctx, ids, keep, param))
    return prompts
