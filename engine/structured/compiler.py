"""Compiling structured-output constraints into token grammars, once per distinct spec.

xgrammar turns a JSON schema, regex or EBNF grammar into a pushdown automaton with a
precomputed token-mask cache for one tokenizer. Compiling takes milliseconds to seconds,
so the server compiles off the engine thread before it submits a request
(``await asyncio.to_thread(compiler.compile, spec)``); the engine thread then finds the
grammar in the cache. A burst of identical specs compiles once: concurrent callers of the
same spec wait for the first one's result.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine.errors import GrammarError
from engine.request import StructuredOutputs

DEFAULT_CACHE_SIZE = 256
# Compiling spends most of its time precomputing masks; two threads suit the small CPUs
# this runs on and leave the engine thread its core.
DEFAULT_COMPILE_THREADS = 2
# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (...) is false: "; users need only the rest.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for this engine's tokenizer; matchers are made from ``grammar``."""

    spec: StructuredOutputs
    grammar: xgr.CompiledGrammar
    compile_seconds: float


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one tokenizer and caches the results (LRU).

    Thread-safe. ``vocab_size`` is the model's (the width of its logits), which may exceed
    the tokenizer's; ``stop_token_ids`` end a completed grammar (the model's EOS ids).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...] = (),
        *,
        max_cached: int = DEFAULT_CACHE_SIZE,
        max_threads: int = DEFAULT_COMPILE_THREADS,
    ) -> None:
        stops = list(stop_token_ids) or None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops
        )
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(self.tokenizer_info.stop_token_ids)
        self.max_cached = max_cached
        # Our own bounded cache (by spec) replaces xgrammar's unbounded one.
        self._xgr = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()
        self._in_flight: dict[StructuredOutputs, Future[CompiledGrammar]] = {}
        self.num_compiled = 0  # compilations actually run (cache misses that succeeded)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache when it is there.

        Raises ``GrammarError`` (a ValueError) saying what is wrong with the spec.
        """
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
            pending = self._in_flight.get(spec)
            owner = pending is None
            if pending is None:
                pending = self._in_flight[spec] = Future()
        if not owner:
            return pending.result()
        try:
            compiled = self._compile_uncached(spec)
        except GrammarError as exc:
            self._finish(spec, pending, error=exc)
            raise
        self._finish(spec, pending, result=compiled)
        return compiled

    def cached(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            return spec in self._cache

    def _finish(
        self,
        spec: StructuredOutputs,
        pending: Future[CompiledGrammar],
        *,
        result: CompiledGrammar | None = None,
        error: GrammarError | None = None,
    ) -> None:
        with self._lock:
            del self._in_flight[spec]
            if result is not None:
                self.num_compiled += 1
                self._cache[spec] = result
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        if error is not None:
            pending.set_exception(error)
        else:
            assert result is not None
            pending.set_result(result)

    def _compile_uncached(self, spec: StructuredOutputs) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            grammar = self._compile_kind(spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{_what(spec)} cannot be compiled: {_clean(exc)}") from exc
        return CompiledGrammar(spec, grammar, time.perf_counter() - start)

    def _compile_kind(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        # Compact JSON layout (", " and ": ", no free whitespace): small models given any
        # whitespace tend to emit it forever instead of the next key.
        if spec.kind == "json_schema":
            _parse_json(spec.value, "json_schema")
            return self._xgr.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            if not spec.value:
                raise GrammarError("the regex is empty")
            return self._xgr.compile_regex(spec.value)
        if spec.kind == "choice":
            return self._xgr.compile_grammar(choice_grammar(spec.value))
        if spec.kind == "grammar":
            if not spec.value.strip():
                raise GrammarError("the grammar is empty")
            return self._xgr.compile_grammar(spec.value)
        raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def choice_grammar(value: str) -> str:
    """EBNF for "exactly one of the JSON-encoded list of strings ``value``"."""
    options = _parse_json(value, "choice")
    if not isinstance(options, list) or not options:
        raise GrammarError("choice must be a non-empty list of strings")
    if not all(isinstance(option, str) for option in options):
        raise GrammarError("choice must contain only strings")
    # JSON string literals are valid EBNF literals: quotes, backslashes and control
    # characters come escaped.
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"{what} is not valid JSON: {exc}") from exc


def _what(spec: StructuredOutputs) -> str:
    return {
        "json_schema": "the JSON schema",
        "json_object": "the JSON object grammar",
        "regex": "the regex",
        "choice": "the choice list",
        "grammar": "the grammar",
    }.get(spec.kind, spec.kind)


def _clean(exc: BaseException) -> str:
    lines = [_NATIVE_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__
