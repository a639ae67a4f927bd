"""Constrained decoding: structured-output specs compiled into token grammars (xgrammar),
and the per-request grammar state that masks the logits of constrained rows.

This package is the one place the grammar library is imported.
"""

from engine.structured.compiler import CompiledGrammar, GrammarCompiler
from engine.structured.decoding import GrammarDecoding

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarDecoding"]
