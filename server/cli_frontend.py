"""Command-line flags of the OpenAI front end's behaviour: chat templates and CORS,
named as vLLM names them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from server.chat_template import CONTENT_FORMATS, load_chat_template


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI front end")
    group.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template: a file path or the template itself (default: the model's)",
    )
    group.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMATS,
        help="message content as one string or as OpenAI's list of parts (auto: detect)",
    )
    for name, default, what in (
        ("--allowed-origins", [], "origins allowed by CORS ('*' = any; default: CORS off)"),
        ("--allowed-methods", ["*"], "HTTP methods allowed by CORS"),
        ("--allowed-headers", ["*"], "request headers allowed by CORS"),
    ):
        group.add_argument(name, nargs="+", default=default, help=f"{what}; or a JSON list")
    group.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow cookies/credentials"
    )


def frontend_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerSettings keywords from the parsed flags; ValueError for a bad template."""
    return {
        "chat_template": load_chat_template(args.chat_template),
        "chat_template_content_format": args.chat_template_content_format,
        "allowed_origins": _list_flag(args.allowed_origins),
        "allowed_methods": _list_flag(args.allowed_methods),
        "allowed_headers": _list_flag(args.allowed_headers),
        "allow_credentials": args.allow_credentials,
    }


def _list_flag(values: list[str]) -> tuple[str, ...]:
    """Space-separated values, or vLLM's JSON list form (``'["http://a", "http://b"]'``)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list: {values[0]}") from exc
        return tuple(str(v) for v in parsed)
    return tuple(values)
