"""Structured outputs: from the request fields that ask for them to one engine constraint.

Accepted (at most one per request; two at once is a 400):
- OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
  object), ``json_schema`` (``{"name", "schema", "strict", "description"}``; the schema
  is always enforced, ``strict`` or not).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or JSON text),
  ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF/GBNF), ``json_object: true``.
- vLLM's legacy fields (removed in vLLM 0.12, kept here because clients still send them):
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
- Forced tool calls (server/tools/plan.py) produce a constraint of their own.

A constraint is compiled by the engine's grammar compiler before the request is submitted
(off the event loop; compiled grammars are cached, so the engine's own compile is a cache
hit); a grammar it cannot compile is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.errors import invalid

SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class _Strict(BaseModel):
    # The rules of server.protocol.StrictModel (defined here to avoid an import cycle).
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaSpec(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _valid_name(self) -> JsonSchemaSpec:
        if not SCHEMA_NAME.match(self.name):
            raise ValueError("'name' must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
        return self


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs`` request object (the constraints kvserve supports)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


@dataclass(frozen=True)
class Constraint:
    """One output constraint and the request field it came from (named in errors)."""

    kind: ConstraintKind
    value: str
    param: str

    def spec(self, after: tuple[int, ...] = (), opener: int | None = None) -> Any:
        """The engine's ``StructuredOutputs`` for this constraint (applying once the
        ``after`` tokens appeared in the output, when given; with ``opener``, only when
        the output opened with it)."""
        from engine.request import StructuredOutputs

        return StructuredOutputs(kind=self.kind, value=self.value, after=after, opener=opener)


def schema_constraint(schema: dict[str, Any], param: str) -> Constraint:
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), param)


def requested_constraints(body: Any) -> list[Constraint]:
    """Every constraint the request's structured-output fields ask for (0, 1, or more:
    the caller refuses more than one)."""
    found: list[Constraint] = []
    fmt = getattr(body, "response_format", None)
    if isinstance(fmt, JsonObjectFormat):
        found.append(Constraint("json_object", "", "response_format"))
    elif isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            found.append(Constraint("json_object", "", "response_format"))
        else:
            found.append(schema_constraint(schema, "response_format.json_schema.schema"))
    params = getattr(body, "structured_outputs", None)
    if params is not None:
        found += _vllm_constraints(params)
    found += _legacy_constraints(body)
    return found


def _vllm_constraints(params: StructuredOutputsParams) -> list[Constraint]:
    found = []
    if params.json_ is not None:
        found.append(_json_value(params.json_, "structured_outputs.json"))
    if params.regex is not None:
        found.append(Constraint("regex", params.regex, "structured_outputs.regex"))
    if params.choice is not None:
        found.append(_choice(params.choice, "structured_outputs.choice"))
    if params.grammar is not None:
        found.append(Constraint("grammar", params.grammar, "structured_outputs.grammar"))
    if params.json_object:
        found.append(Constraint("json_object", "", "structured_outputs.json_object"))
    if not found:
        raise invalid(
            "'structured_outputs' must set one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return found


def _legacy_constraints(body: Any) -> list[Constraint]:
    found = []
    if getattr(body, "guided_json", None) is not None:
        found.append(_json_value(body.guided_json, "guided_json"))
    if getattr(body, "guided_regex", None) is not None:
        found.append(Constraint("regex", body.guided_regex, "guided_regex"))
    if getattr(body, "guided_choice", None) is not None:
        found.append(_choice(body.guided_choice, "guided_choice"))
    if getattr(body, "guided_grammar", None) is not None:
        found.append(Constraint("grammar", body.guided_grammar, "guided_grammar"))
    return found


def _json_value(value: dict[str, Any] | str, param: str) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(f"'{param}' is not valid JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise invalid(f"'{param}' must be a JSON schema object", param)
    return schema_constraint(value, param)


def _choice(choices: list[str], param: str) -> Constraint:
    if not choices:
        raise invalid(f"'{param}' must list at least one string", param)
    return Constraint("choice", json.dumps(choices, ensure_ascii=False), param)


def single_constraint(constraints: list[Constraint]) -> Constraint | None:
    """The request's one constraint; two at once is a 400 naming both."""
    if len(constraints) > 1:
        names = " and ".join(f"'{c.param}'" for c in constraints)
        raise invalid(
            f"{names} each constrain the output; give at most one per request",
            constraints[1].param,
        )
    return constraints[0] if constraints else None


async def check_compiles(compiler: Any, constraints: Sequence[Constraint]) -> None:
    """Compile each constraint off the event loop; a GrammarError is a 400 naming the
    field it came from."""
    from engine.errors import GrammarError

    for constraint in constraints:
        try:
            await asyncio.to_thread(compiler.compile, constraint.spec())
        except GrammarError as exc:
            raise invalid(
                f"'{constraint.param}' cannot be used to constrain the output: {exc}",
                constraint.param,
                code="invalid_grammar",
            ) from None


async def constrained(
    compiler: Any,
    params: Any,
    constraint: Constraint | None,
    checks: Sequence[Constraint] = (),
    after: tuple[int, ...] = (),
    opener: int | None = None,
) -> Any:
    """``params`` (SamplingParams) with the constraint, once it compiled; ``checks`` are
    compiled first so that a failure names the narrowest field; ``after``: the tokens the
    constraint waits for, ``opener``: the token whose opening makes it wait
    (server/reasoning.py)."""
    if constraint is None:
        return params
    if compiler is None:
        message = "this engine has no grammar compiler: structured outputs are off"
        raise invalid(message, constraint.param)
    await check_compiles(compiler, [*checks, constraint])
    return dataclasses.replace(params, structured_outputs=constraint.spec(after, opener))
