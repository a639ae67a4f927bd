"""What a request body's unknown top-level fields get: ignored (the default) or refused.

A server behind middleware sees bodies it did not design: vllm-router re-serialises every
chat request with fields of its own (``no_stop_trim``, ``separate_reasoning``,
``stream_reasoning``, ``return_hidden_states``, ``include_reasoning``), gateways add
tracing keys, SDKs grow fields faster than servers. OpenAI refuses unknown fields; vLLM
ignores them with a logged warning. kvserve's policy (``--unknown-fields``):

* ``ignore`` (default): a top-level key no field of the route's model knows is dropped
  before validation. The answer names what was dropped in the ``X-Kvserve-Ignored-Fields``
  header, ``kvserve_request_fields_ignored_total{field}`` counts it, and the first request
  to carry a given name logs a warning (later ones log at debug, so a router that adds
  five fields to every request does not flood the log).
* ``reject``: every unknown key is a 400 naming it, as OpenAI answers.

Only top-level keys are ever ignored. A misspelt key inside a message, a tool or a schema
changes what the request means and stays a 400 under both policies; so do the fields
kvserve knows and does not implement (``functions``, ``audio``, ``suffix``...), which are
refused by name rather than answered as if they were honoured.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

UNKNOWN_FIELD_POLICIES = ("ignore", "reject")
IGNORED_FIELDS_HEADER = "X-Kvserve-Ignored-Fields"
# Bounds on what one client can make the header and the metric carry.
MAX_HEADER_FIELDS = 16
MAX_FIELD_LABELS = 64
OTHER_FIELD_LABEL = "_other"
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")

logger = logging.getLogger("kvserve.server")


def known_fields(model: type[BaseModel]) -> frozenset[str]:
    """Every top-level key ``model`` knows: its field names and their aliases, and the
    names it refuses (a ``refused_fields`` class attribute)."""
    names: set[str] = set(getattr(model, "refused_fields", ()))
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
        if isinstance(info.validation_alias, str):
            names.add(info.validation_alias)
    return frozenset(names)


def split_unknown(data: Any, known: frozenset[str]) -> tuple[Any, tuple[str, ...]]:
    """``data`` without its unknown top-level keys, and those keys in body order. A body
    that is not an object is returned as it is (validation refuses it)."""
    if not isinstance(data, dict):
        return data, ()
    unknown = tuple(key for key in data if key not in known)
    if not unknown:
        return data, ()
    return {key: value for key, value in data.items() if key in known}, unknown


def header_value(fields: tuple[str, ...]) -> str:
    """The header naming ignored fields: at most MAX_HEADER_FIELDS names, each printable
    ASCII (anything else becomes ``?``), then ``...`` if there were more."""
    shown = [_printable(name) for name in fields[:MAX_HEADER_FIELDS]]
    if len(fields) > MAX_HEADER_FIELDS:
        shown.append("...")
    return ", ".join(shown)


def _printable(name: str) -> str:
    return "".join(ch if " " < ch < "\x7f" and ch != "," else "?" for ch in name[:64])


class IgnoredFields:
    """The server's record of fields it ignored: the counter, and the names already
    warned about. ``count`` takes the counter's ``inc`` for a label."""

    def __init__(self, count: Callable[[str], None] | None = None) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._labels: set[str] = set()

    def record(self, route: str, fields: tuple[str, ...]) -> None:
        """Note one request's ignored fields: count each, warn for new names."""
        new: list[str] = []
        with self._lock:
            for name in fields:
                if name not in self._warned and len(self._warned) < MAX_FIELD_LABELS * 4:
                    self._warned.add(name)
                    new.append(name)
                label = self._label(name)
                if self._count is not None:
                    self._count(label)
        if new:
            logger.warning(
                "%s: ignored unknown field(s) %s (--unknown-fields reject refuses them)",
                route,
                ", ".join(_printable(name) for name in new),
            )
        else:
            logger.debug("%s: ignored unknown field(s) %s", route, header_value(fields))

    def _label(self, name: str) -> str:
        """The metric label for a name: itself for the first MAX_FIELD_LABELS plausible
        names, ``_other`` past them, so no client can grow the series without bound."""
        if name in self._labels:
            return name
        if len(self._labels) < MAX_FIELD_LABELS and _LABEL_NAME.fullmatch(name):
            self._labels.add(name)
            return name
        return OTHER_FIELD_LABEL
