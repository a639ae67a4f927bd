"""JSON request bodies parsed, checked and validated off the event loop.

FastAPI parses a JSON body with ``json.loads`` and validates it with pydantic on the event
loop. For a 4 MB body that is no longer free: 500,000 token ids take ~120 ms to parse and
~400 ms to validate, 100,000 chat messages ~150 ms and ~700 ms, every millisecond of it
holding the loop (and with it ``/health`` and every running stream).

``OffLoopBodyRoute``, the route class of every router whose routes take a body, reads the
body on the loop (that is only I/O) and hands the rest to a worker thread of the
request's lane (server/request_cpu.py), ``validated_body``:

1. ``parse_json``: ``json.loads`` with Python-level hooks for integers and objects. The
   hooks cost ~10% but run as bytecode, so the interpreter can hand the GIL to the event
   loop between two numbers or two objects; with the default C callbacks one
   ``json.loads`` holds it for the whole body.
2. ``find_bad_value`` (server/value_check.py): text UTF-8 cannot encode, or a NaN or
   infinite number, is a 400 naming the field, whatever the route and field.
3. ``split_unknown`` (server/unknown_fields.py): under ``--unknown-fields ignore``
   the top-level keys the model does not know are dropped, and named in the answer's
   ``X-Kvserve-Ignored-Fields`` header.
4. ``model.model_validate``: pydantic, with the errors FastAPI itself would report.

FastAPI then receives the finished model: pydantic passes an instance of the expected
model through without validating it again, so the route's signature (and with it the
OpenAPI schema) stays as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from server.errors import invalid
from server.request_cpu import RequestCpu, note_body_bytes
from server.unknown_fields import IGNORED_FIELDS_HEADER, header_value, known_fields, split_unknown
from server.value_check import find_bad_value

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def _int(text: str) -> int:
    # A Python function on purpose: see the module docstring (the GIL).
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def parse_json(raw: bytes) -> Any:
    """The body as Python values; a malformed body is the 400 FastAPI would give."""
    try:
        return json.loads(raw, parse_int=_int, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": ("body", exc.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise RequestValidationError([error]) from exc
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number, nesting too deep
        raise invalid(f"the request body is not usable JSON: {exc}") from exc


# Top-level lists of a conversation's turns: chat's and Messages' ``messages``, Responses'
# ``input`` items. Each entry counts as one message against --max-messages.
TURN_LIST_FIELDS = ("messages", "input")


def validated_body(
    model: type[BaseModel],
    raw: bytes,
    ignorable: frozenset[str] | None = None,
    max_turns: int | None = None,
) -> tuple[BaseModel, tuple[str, ...]]:
    """Parse ``raw``, refuse bad values (server/value_check.py) and conversations of more
    than ``max_turns`` entries, validate against ``model``; with ``ignorable`` (the
    model's known top-level keys), drop the keys not in it first. The model and the keys
    dropped. Blocking: call it from a worker thread."""
    data = parse_json(raw)
    bad = find_bad_value(data)
    if bad is not None:
        raise invalid(bad.message(), bad.path or None)
    if max_turns is not None:
        check_turn_count(data, max_turns, getattr(model, "TURN_LIST_FIELDS", TURN_LIST_FIELDS))
    ignored: tuple[str, ...] = ()
    if ignorable is not None:
        data, ignored = split_unknown(data, ignorable)
    try:
        return model.model_validate(data), ignored
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def check_turn_count(data: Any, limit: int, fields: tuple[str, ...] = TURN_LIST_FIELDS) -> None:
    """Refuse a conversation longer than --max-messages before it is validated: 100,000
    short turns made ~500,000 objects, and the garbage collections they set off held the
    GIL (and so the event loop) ~150 ms at a time. A body model whose lists are not
    turns names its own (``TURN_LIST_FIELDS``: empty for embeddings' ``input``)."""
    if not isinstance(data, dict):
        return
    for field in fields:
        turns = data.get(field)
        if isinstance(turns, list) and len(turns) > limit:
            raise invalid(
                f"'{field}' has {len(turns)} entries; this server accepts at most {limit} "
                "(--max-messages)",
                field,
                code="too_many_messages",
            )


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body is parsed and validated in a worker thread."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        model = self._body_model()
        if model is None:
            return handler
        known = known_fields(model)

        async def parse_then_handle(request: Request) -> Response:
            ignored: tuple[str, ...] = ()
            if _is_json(request.headers.get("content-type")):
                raw = await request.body()
                if raw:  # an empty body is left to FastAPI ("Field required")
                    note_body_bytes(request, len(raw))
                    ctx = request.app.state.ctx
                    cpu: RequestCpu = ctx.request_cpu
                    ignorable = known if ctx.settings.unknown_fields == "ignore" else None
                    limit = ctx.settings.max_messages
                    parsed, ignored = await cpu.run(
                        request, validated_body, model, raw, ignorable, limit
                    )
                    request = _ParsedBodyRequest(request, raw, parsed)
            response = await handler(request)
            if ignored:
                request.app.state.ctx.ignored_fields.record(self.path, ignored)
                response.headers[IGNORED_FIELDS_HEADER] = header_value(ignored)
            return response

        return parse_then_handle

    def _body_model(self) -> type[BaseModel] | None:
        annotation = self.body_field.field_info.annotation if self.body_field else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        return None


class _ParsedBodyRequest(Request):
    """The request with its body already read and its JSON already a validated model."""

    def __init__(self, request: Request, raw: bytes, parsed: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self._raw = raw
        self._parsed = parsed

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._parsed


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule for a body it parses as JSON: ``application/json`` or ``+json``."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
