"""Schema fuzzing of /v1/* (schemathesis over the app's own OpenAPI document).

Bodies generated from the schema -- valid ones and deliberately invalid ones -- go to a
live server on 127.0.0.1. No request may get a 5xx, every documented response must match
its schema, and every 4xx must be an error in the API's own shape (OpenAI's; Anthropic's
on the Messages routes). The run is bounded and
reproducible: a fixed number of examples per operation, derandomized, no deadline.

The server serves the tiny model with a short context so valid generations stay cheap.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from server.settings import ServerSettings  # noqa: E402
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server  # noqa: E402

EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    built = build_tiny(tiny_model_dir, max_model_len=96, num_kv_blocks=64)
    settings_ = ServerSettings(served_model_names=(TINY_MODEL_NAME,), max_n=4)
    with live_server(built, settings_) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer) -> Any:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    schema.config.update(base_url=fuzz_server.url)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema.include(path_regex="^/v1/")


def check_case(case: Any, statuses: Counter[int]) -> None:
    response = case.call(timeout=60)
    statuses[response.status_code] += 1
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
    if 400 <= response.status_code < 500:
        body = response.json()
        if case.operation.path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            error = body["error"]
        else:
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error


def served_model(case: Any) -> Any:
    """Most valid bodies name a random model (a 404): name the served one in two of three
    so that generation itself gets fuzzed too."""
    body = case.body
    named = isinstance(body, dict) and isinstance(body.get("model"), str)
    if named and zlib.crc32(repr(body).encode()) % 3:
        body["model"] = TINY_MODEL_NAME
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_v1_never_500_and_matches_its_schema(api_schema: Any, mode: GenerationMode) -> None:
    # (schemathesis' own pytest integration does not run under pytest 9: drive each
    # operation's hypothesis strategy directly.)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    statuses: Counter[int] = Counter()
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode).map(served_model))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            check_case(case, statuses)

        try:
            fuzz()
        except Unsatisfiable:
            if mode is GenerationMode.NEGATIVE:
                continue  # nothing to break: e.g. GET /v1/models takes no input at all
            raise
        except Exception as exc:
            raise AssertionError(f"{operation.method.upper()} {operation.path}: {exc}") from exc
    # Valid bodies reached real generations; invalid ones were refused, all with 4xx.
    if mode is GenerationMode.POSITIVE:
        assert sum(n for status, n in statuses.items() if status < 300) > 0, statuses
    else:
        assert statuses and all(400 <= status < 500 for status in statuses), statuses


def test_the_server_is_clean_after_fuzzing(fuzz_server: LiveServer) -> None:
    stats = fuzz_server.wait_idle(timeout_s=60)
    assert stats.device_blocks.used == 0
    assert fuzz_server.ctx.engine.is_alive
