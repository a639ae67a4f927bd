"""lm-evaluation-harness loglikelihood requests, replayed from a recording (issue 13).

``lm_eval_fixture/recording.json`` holds what lm-eval 0.4.13's ``local-completions`` model
sent to a live kvserve (``echo`` + ``logprobs`` + ``max_tokens: 1`` over batches of token
id prompts) for the local task ``lm_eval_fixture/kvserve_tiny.yaml``, what kvserve answered,
and the loglikelihoods lm-eval concluded. lm-eval itself is not a dependency: it pulls ~40
packages (datasets, pyarrow, pandas, scipy, ...) that CI does not install, hence the
recording; ``lm_eval_fixture/record.py`` re-records it.

The test replays the requests against today's server and parses the answers the way
lm-eval does (the continuation's ``token_logprobs`` summed; greedy when every continuation
token is its position's top alternative): the results must be lm-eval's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer

RECORDING = Path(__file__).parent / "lm_eval_fixture" / "recording.json"


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDING.read_text())
    return data


def continuation_len(tokenizer: Any, context: str, continuation: str) -> int:
    """lm-eval's _encode_pair: trailing spaces of the context move to the continuation."""
    stripped = context.rstrip(" ")
    continuation = context[len(stripped) :] + continuation
    whole = tokenizer.encode(stripped + continuation, add_special_tokens=False)
    return len(whole) - len(tokenizer.encode(stripped, add_special_tokens=False))


def parse_choice(choice: dict[str, Any], num_continuation: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs for one echoed choice (its last token is the sampled one)."""
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"][:-1][-num_continuation:]
    values = logprobs["token_logprobs"][:-1][-num_continuation:]
    tops = logprobs["top_logprobs"][:-1][-num_continuation:]
    greedy = all(max(top, key=top.get) == token for token, top in zip(tokens, tops, strict=True))
    return float(sum(values)), greedy


@pytest.mark.slow
def test_lm_eval_loglikelihood_requests_replayed(server: LiveServer, recording: dict[str, Any]):
    tokenizer = server.ctx.tokenizer
    answers: dict[tuple[int, ...], dict[str, Any]] = {}
    for body in recording["requests"]:
        assert body["echo"] is True and body["max_tokens"] == 1 and body["logprobs"] == 1
        response = httpx.post(f"{server.v1}/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        prompts = body["prompt"]
        for choice in response.json()["choices"]:
            prompt = prompts[choice["index"]]
            assert choice["logprobs"]["token_logprobs"][0] is None
            assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1
            answers[tuple(prompt)] = choice
    checked = 0
    for sample in recording["samples"]:
        for (context, continuation), (expected, greedy) in zip(
            sample["arguments"], sample["loglikelihoods"], strict=True
        ):
            whole = tuple(tokenizer.encode(context + continuation, add_special_tokens=False))
            choice = answers[whole]
            n = continuation_len(tokenizer, context, continuation)
            value, is_greedy = parse_choice(choice, n)
            assert value == pytest.approx(expected, abs=2e-3), (context, continuation)
            assert is_greedy == greedy
            checked += 1
    assert checked == sum(len(s["arguments"]) for s in recording["samples"]) > 0
    server.wait_idle()
