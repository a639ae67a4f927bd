"""argparse value types for kvserve-loadtest: each names the bound a value broke, so a bad
flag reads ``argument -c/--concurrency: must be an integer >= 1, got '0'``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from loadtest.config import LengthDist


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def number(*, above: float | None = None, at_least: float | None = None) -> Callable[[str], float]:
    bound = f"> {above:g}" if above is not None else f">= {at_least:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        too_low = (above is not None and value <= above) or (
            at_least is not None and value < at_least
        )
        if too_low or value != value:  # NaN compares false with everything
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


LENGTH_FORMS = "N, uniform:MEAN:HALF_WIDTH or lognormal:MEDIAN:SIGMA (N, MEAN, MEDIAN >= 1)"


def length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {LENGTH_FORMS}, got {text!r}") from None


def url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must start with http:// or https://, got {text!r}")
    return text


def url_list(text: str) -> list[str]:
    """One URL or a comma-separated list of them (for repeatable URL flags)."""
    return [url(part.strip()) for part in text.split(",") if part.strip()]
