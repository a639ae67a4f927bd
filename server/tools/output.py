"""Per-choice output processing for chat completions: plain text, free output parsed for
tool calls (``auto``), or a forced call's constrained JSON (``required`` / named)."""

from __future__ import annotations

from typing import Protocol

from server.tools.constrained import NamedCallOutput, RequiredCallsOutput
from server.tools.events import ContentText, OutputEvent
from server.tools.parsers import make_parser
from server.tools.plan import ToolPlan


class ChoiceOutput(Protocol):
    def feed(self, text: str) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


class PlainOutput:
    def feed(self, text: str) -> list[OutputEvent]:
        return [ContentText(text)] if text else []

    def finish(self) -> list[OutputEvent]:
        return []


def choice_output(plan: ToolPlan) -> ChoiceOutput:
    """A fresh processor for one choice of a request planned as ``plan``."""
    if plan.mode == "named":
        assert plan.named is not None
        return NamedCallOutput(plan.named)
    if plan.mode == "required":
        return RequiredCallsOutput(plan.parallel)
    if plan.mode == "auto":
        assert plan.parser is not None
        names = [t.function.name for t in plan.tools]
        return make_parser(plan.parser, names, None if plan.parallel else 1)
    return PlainOutput()


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A choice that ended normally after calling tools reports ``tool_calls``."""
    return "tool_calls" if called_tools and reason == "stop" else reason
