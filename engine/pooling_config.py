"""What a model directory says about pooling: sentence-transformers' Pooling and Normalize
modules, whether it was trained for Matryoshka (truncatable) embeddings, and the
activation a cross-encoder's score goes through (sentence-transformers' CrossEncoder
writes it into config.json).

Read once at start-up, torch-free; the server's embeddings route combines it with
``--pooling`` (server/embeddings.py). A GGUF file or a plain causal LM says nothing:
``ModelPooling()``, whose pooling is decided by the server's default.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling config keys -> kvserve's pooling kinds.
_ST_MODES = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)


@dataclass(frozen=True)
class ModelPooling:
    """``kind``: the pooling the model was trained with (None: not stated);
    ``normalize``: whether its sentence-transformers pipeline ends in Normalize (None:
    not stated); ``matryoshka``: its embeddings may be truncated; ``dimensions``: the
    truncations it was trained for (empty: any up to the hidden size);
    ``score_activation``: a cross-encoder's activation as config.json names it (a
    ``torch.nn.modules`` qualname; None: not stated, a sigmoid for one label)."""

    kind: str | None = None
    normalize: bool | None = None
    matryoshka: bool = False
    dimensions: tuple[int, ...] = ()
    score_activation: str | None = None


def read_model_pooling(directory: Path | None) -> ModelPooling:
    """The pooling facts of a Hugging Face directory (None: a GGUF file, nothing read)."""
    if directory is None:
        return ModelPooling()
    config = _json(directory / "config.json")
    dimensions = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    matryoshka = bool(config.get("is_matryoshka")) or bool(dimensions)
    kind, normalize = _sentence_transformers(directory)
    return ModelPooling(kind, normalize, matryoshka, dimensions, _score_activation(config))


def _score_activation(config: dict[str, Any]) -> str | None:
    """sentence-transformers >= 4 writes ``sentence_transformers.activation_fn``, older
    releases ``sbert_ce_default_activation_function``."""
    current = config.get("sentence_transformers")
    if isinstance(current, dict) and current.get("activation_fn"):
        return str(current["activation_fn"])
    older = config.get("sbert_ce_default_activation_function")
    return str(older) if older else None


def _sentence_transformers(directory: Path) -> tuple[str | None, bool | None]:
    modules = _json(directory / "modules.json", default=[])
    if not isinstance(modules, list) or not modules:
        return None, None
    kind = None
    normalize = False
    for module in modules:
        kind_name = str(module.get("type", ""))
        if kind_name.endswith("Pooling"):
            pooling = _json(directory / str(module.get("path", "")) / "config.json")
            kind = next((mode for key, mode in _ST_MODES if pooling.get(key)), None)
        elif kind_name.endswith("Normalize"):
            normalize = True
    return kind, normalize


def _json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {} if default is None else default
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return {} if default is None else default
