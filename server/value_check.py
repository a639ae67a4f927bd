"""The one check of every value in a parsed JSON body: text that UTF-8 can encode, and
numbers that are finite.

- **Unencodable text.** JSON may spell any UTF-16 code unit as ``\\uXXXX``, so a valid
  body can carry a lone surrogate (``"\\ud800"``): Python decodes it into a ``str`` that no
  UTF-8 encoder accepts, and the tokenizer, the chat template or the response's own JSON
  then fail with a TypeError or UnicodeEncodeError. Surrogates are the only code points a
  decoded JSON string can hold that UTF-8 cannot (the raw body itself must be valid
  UTF-8), so a string is encodable exactly when ``str.encode("utf-8")`` succeeds.
- **Non-finite numbers.** Python's parser accepts ``NaN``, ``Infinity`` and
  ``-Infinity`` (not JSON at all) and reads ``1e999`` (valid JSON) as infinity. Range
  checks then say something misleading ("less than or equal to 2" for a NaN
  temperature), and a NaN inside a schema or template argument is written back out as
  invalid JSON.

``find_bad_value`` walks the whole body -- values and object keys, every route and field
alike -- and names the first bad value by its path, in the dotted form validation errors
use (``messages.0.content``). It is iterative: a body nested as deep as the JSON parser
allows does not exhaust the stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BadValue:
    """Where the bad value is and what is wrong with it."""

    path: str  # dotted, e.g. "tools.0.function.description"; "" for the body itself
    problem: str  # "contains U+D800, a lone UTF-16 surrogate ..." / "must be a finite ..."
    in_key: bool = False  # an object key under ``path``, not a value

    def message(self) -> str:
        if self.in_key:
            where = f"a key of '{self.path}'" if self.path else "a key of the body"
        else:
            where = f"'{self.path}'" if self.path else "the body"
        return f"{where} {self.problem}"


def find_bad_value(value: Any) -> BadValue | None:
    """The first string (value or key) UTF-8 cannot encode, or non-finite number, in
    ``value``; None when there is none."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = _text_problem(item)
            if problem is not None:
                return BadValue(path, problem)
        elif isinstance(item, float):
            if not math.isfinite(item):
                return BadValue(path, f"must be a finite number, got {_spell(item)}")
        elif isinstance(item, dict):
            for key in item:
                problem = _text_problem(key) if isinstance(key, str) else None
                if problem is not None:
                    return BadValue(path, problem, in_key=True)
            # Reversed onto the stack, so the body is searched in document order.
            stack.extend((_join(path, key), item[key]) for key in reversed(item))
        elif isinstance(item, list):
            stack.extend((_join(path, i), item[i]) for i in reversed(range(len(item))))
    return None


def _text_problem(text: str) -> str | None:
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"contains U+{ord(text[exc.start]):04X}, a lone UTF-16 surrogate that is not a "
            "character and cannot be encoded as UTF-8; send valid Unicode text"
        )
    return None


def _spell(number: float) -> str:
    if math.isnan(number):
        return "NaN"
    return "Infinity" if number > 0 else "-Infinity"


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)
