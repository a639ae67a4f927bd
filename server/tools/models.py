"""OpenAI's tool-calling request shapes: ``tools``, ``tool_choice`` and the tool calls that
assistant messages carry in the history.

Validated with the same rules as ``server.protocol.StrictModel`` (wrong types and unknown
fields are errors); defined here so ``server.protocol`` can import them without a cycle.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(ToolModel):
    name: str
    description: str | None = None
    # A JSON schema for the arguments object; OpenAI's default is "no parameters".
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not FUNCTION_NAME.match(name):
            raise ValueError("function names must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
        return name

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments schema the model must satisfy (an empty object when omitted)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters

    def as_openai(self) -> dict[str, Any]:
        """The function as OpenAI and chat templates spell it (no null fields)."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters_schema
        return out


class ToolDefinition(ToolModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ToolModel):
    name: str


class NamedToolChoice(ToolModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(ToolModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's convention)

    def arguments_object(self) -> Any:
        """The arguments decoded, or the raw string when it is not JSON (templates that
        expect a mapping still get something to print)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


class ToolCallMessage(ToolModel):
    """A tool call in an assistant message of the history."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall
