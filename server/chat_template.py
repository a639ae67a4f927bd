"""Chat templates: which template, how messages reach it, and its errors as 400s.

* ``--chat-template`` (a file or inline Jinja) replaces the tokenizer's template.
* ``--chat-template-content-format`` as vLLM names it: ``string`` passes each message's
  content as one string, ``openai`` as the list of ``{"type": "text", "text": ...}``
  parts, ``auto`` picks ``openai`` when the template loops over a message's content and
  ``string`` otherwise.
* ``role: "developer"`` is rendered as ``system`` when the template knows no developer
  role; a message's ``name`` is passed through.
* ``chat_template_kwargs`` reach the template as variables (e.g. Qwen3's
  ``enable_thinking``); ``continue_final_message`` renders the final assistant message
  open, so the reply continues it (prefill).
* A template that raises (Mistral, Gemma and Llama-2 templates do on roles that do not
  alternate) is a 400 with the template's message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jinja2

from server.errors import invalid
from server.protocol import ChatMessage
from server.tools.models import ToolDefinition
from server.tools.prompt import build_conversation, source_supports_tools, template_supports_tools

ContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS: tuple[str, ...] = ("auto", "string", "openai")

# Template variables kvserve sets itself: a request may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_assistant_tokens_mask",
        "tools",
        "documents",
    }
)
# A loop over a message's content: ``for part in message['content']`` and the like.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the contents of a file when ``value`` names one, else the
    value itself as inline Jinja (vLLM's rule). Raises ValueError for a bad template."""
    if value is None:
        return None
    path = Path(value)
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path:
        if not path.is_file():
            raise ValueError(f"--chat-template: no such file: {value}")
        value = path.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template is not valid Jinja: {exc}") from exc
    return value


@dataclass(frozen=True)
class ChatTemplateOptions:
    """One request's rendering controls."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Functions offered to the model (server/tools/prompt.py: through the template when it
    # takes ``tools``, else as a generic system prompt).
    tools: tuple[ToolDefinition, ...] = ()


class ChatTemplate:
    """Renders conversations with one template (the server's or the tokenizer's)."""

    def __init__(self, tokenizer: Any, override: str | None, content_format: str) -> None:
        self.tokenizer = tokenizer
        self.source: str | None = override or _template_source(tokenizer)
        self.content_format = resolve_content_format(self.source or "", content_format)
        self.has_developer_role = "developer" in (self.source or "")
        self.takes_tools = (
            source_supports_tools(override) if override else template_supports_tools(tokenizer)
        )

    def render(self, messages: Sequence[ChatMessage], options: ChatTemplateOptions) -> str:
        if self.source is None:
            raise invalid("this model has no chat template; use /v1/completions", "messages")
        check_template_kwargs(options.kwargs)
        conversation, tool_kwargs = build_conversation(messages, options.tools, self.takes_tools)
        try:
            text: str = self.tokenizer.apply_chat_template(
                [self._shape(entry) for entry in conversation],
                chat_template=self.source,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                **options.kwargs,
                **tool_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise invalid(f"the chat template failed: {exc}", "messages") from exc
        except ValueError as exc:  # transformers' own checks (continue_final_message)
            raise invalid(f"the chat template could not render: {exc}", "messages") from exc
        return text

    def _shape(self, entry: dict[str, Any]) -> dict[str, Any]:
        """A conversation entry as this template wants it: ``developer`` as ``system``
        when the template has no developer role, content as a string or as parts."""
        if entry["role"] == "developer" and not self.has_developer_role:
            entry = {**entry, "role": "system"}
        if self.content_format == "openai" and isinstance(entry.get("content"), str):
            entry = {**entry, "content": [{"type": "text", "text": entry["content"]}]}
        return entry


def resolve_content_format(source: str, setting: str) -> str:
    """``auto``: ``openai`` when the template iterates over a message's content."""
    if setting != "auto":
        return setting
    return "openai" if _LOOPS_OVER_CONTENT.search(source) else "string"


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if clash:
        raise invalid(
            f"'chat_template_kwargs' may not set {', '.join(clash)}: use the request fields",
            "chat_template_kwargs",
        )


def _template_source(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return template if isinstance(template, str) and template else None
