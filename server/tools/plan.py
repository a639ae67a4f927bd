"""What a chat request's tool fields mean for this request: which tools the prompt
offers, whether decoding is constrained to a call, and how output becomes tool calls.

``tool_choice`` (OpenAI's default: ``auto`` when tools are given, else ``none``):
- ``none``: the tools are not rendered into the prompt and the output is plain content
  (as vLLM with ``--exclude-tools-when-tool-choice-none``).
- ``auto``: the model may answer or call tools; calls are parsed out of the output with
  ``--tool-call-parser``. Needs ``--enable-auto-tool-choice``, as in vLLM, which answers
  400 without it.
- ``required``: decoding is constrained to one call of an offered function (several when
  ``parallel_tool_calls`` is true), see server/tools/constrained.py.
- ``{"type": "function", "function": {"name": N}}``: constrained to one call of N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.errors import invalid
from server.settings import ServerSettings
from server.structured import Constraint, schema_constraint
from server.tools.constrained import named_call_schema, required_call_schema
from server.tools.models import NamedToolChoice, ToolDefinition

ToolMode = Literal["off", "none", "auto", "required", "named"]

AUTO_NEEDS_FLAG = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode = "off"
    # Tools rendered into the prompt (empty for "off" and "none").
    tools: tuple[ToolDefinition, ...] = ()
    parallel: bool = True
    named: str | None = None
    parser: str | None = None
    # The output constraint of a forced call, and the schemas to compile first so that a
    # failure names the tool it came from.
    constraint: Constraint | None = None
    checks: tuple[Constraint, ...] = ()

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")


def plan_tools(body: Any, settings: ServerSettings) -> ToolPlan:
    tools: list[ToolDefinition] = list(body.tools or ())
    choice = body.tool_choice
    parallel = body.parallel_tool_calls
    if choice is not None and not tools:
        raise invalid("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if not tools:
        return ToolPlan(parallel=parallel)
    _check_tools(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(mode="none", parallel=parallel)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise invalid(AUTO_NEEDS_FLAG, "tool_choice")
        return ToolPlan("auto", tuple(tools), parallel, parser=settings.tool_call_parser)
    checks = tuple(_parameters_check(i, t) for i, t in enumerate(tools))
    if isinstance(choice, NamedToolChoice):
        index = _tool_index(tools, choice.function.name)
        function = tools[index].function
        constraint = schema_constraint(named_call_schema(function), checks[index].param)
        return ToolPlan("named", tuple(tools), parallel, named=function.name, constraint=constraint)
    schema = required_call_schema([t.function for t in tools], parallel)
    return ToolPlan(
        "required",
        tuple(tools),
        parallel,
        constraint=schema_constraint(schema, "tools"),
        checks=checks,
    )


def _tool_index(tools: Sequence[ToolDefinition], name: str) -> int:
    for i, tool in enumerate(tools):
        if tool.function.name == name:
            return i
    offered = ", ".join(t.function.name for t in tools)
    raise invalid(
        f"'tool_choice' names the function '{name}', which is not among the 'tools' ({offered})",
        "tool_choice",
    )


def _parameters_check(i: int, tool: ToolDefinition) -> Constraint:
    return schema_constraint(tool.function.parameters_schema, f"tools[{i}].function.parameters")


def _check_tools(tools: Sequence[ToolDefinition]) -> None:
    """Names unique, parameters a valid JSON schema of an object."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise invalid(f"function name '{name}' appears twice in 'tools'", f"tools[{i}]")
        seen.add(name)
        schema = tool.function.parameters_schema
        param = f"tools[{i}].function.parameters"
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise invalid(f"'{param}' is not a valid JSON schema: {exc.message}", param) from None
        if schema.get("type", "object") != "object":
            raise invalid(f"'{param}' must describe a JSON object (type 'object')", param)


def output_constraint(plan: ToolPlan, requested: list[Constraint]) -> Constraint | None:
    """The one constraint of a chat request: a structured-output field or a forced call.

    ``auto`` with a constraint is refused too: the constrained output could never hold a
    tool call, so the tools would be offered for nothing.
    """
    from server.structured import single_constraint

    if plan.constraint is not None:
        requested = [*requested, plan.constraint]
    constraint = single_constraint(requested)
    if plan.mode == "auto" and constraint is not None:
        raise invalid(
            f"'{constraint.param}' constrains the output, so with tool_choice 'auto' the "
            "model could never call a tool; use tool_choice 'required' or a named function "
            "to force a call, or 'none'",
            constraint.param,
        )
    return constraint
