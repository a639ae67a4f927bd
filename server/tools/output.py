"""Per-choice output processing: plain text, free output parsed for tool calls
(``auto``), or a forced call's constrained JSON (``required`` / named), behind the
reasoning the model wrote first when a ``--reasoning-parser`` splits it off."""

from __future__ import annotations

from typing import Protocol

from server.reasoning import ReasoningFormat, ReasoningSplitter
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


class ReasoningOutput:
    """Reasoning events first, then the answer through ``answer``'s processing."""

    def __init__(self, fmt: ReasoningFormat, answer: ChoiceOutput) -> None:
        self._splitter = ReasoningSplitter(fmt)
        self._answer = answer

    def feed(self, text: str) -> list[OutputEvent]:
        events, answer = self._splitter.feed(text)
        return events + (self._answer.feed(answer) if answer else [])

    def finish(self) -> list[OutputEvent]:
        events, answer = self._splitter.finish()
        return events + (self._answer.feed(answer) if answer else []) + self._answer.finish()


def choice_output(plan: ToolPlan, reasoning: ReasoningFormat | None = None) -> ChoiceOutput:
    """A fresh processor for one choice of a request planned as ``plan``."""
    answer = _answer_output(plan)
    return answer if reasoning is None else ReasoningOutput(reasoning, answer)


def _answer_output(plan: ToolPlan) -> ChoiceOutput:
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
