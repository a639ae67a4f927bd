"""Text to token ids for the routes, in a worker thread, without holding the GIL for long.

Tokenizing a 4 MB prompt takes seconds; the routes run it in a worker thread
(``asyncio.to_thread``) so the event loop keeps serving. A thread only helps while the
tokenizer lets go of the GIL, and the usual call does not for long stretches:
``tokenizer.encode`` of 3.9 MB of text (870,000 tokens) turns the Rust encoding into
Python lists of ids, attention mask and more in single calls of ~60-110 ms each, and a
single ``Tokenizer.encode`` holds the GIL for the whole encode (3.4 s).

``encode_text`` asks the Rust tokenizer for one encoding through ``encode_batch_fast``,
which releases the GIL while it works (and skips the character offsets nobody reads
here), then reads the ids in slices of ``IDS_PER_SLICE`` (``Encoding.truncate`` moves the
rest into ``overflowing``): splitting 870,000 ids holds the GIL ~13 ms, each slice of
1,024 ~0.1 ms, where one ``.ids`` held it ~66 ms (an engine step waits for the slice in
hand each time it takes the GIL back, server/request_cpu.py). The ids are those
of ``tokenizer.encode``: the same Rust call transformers makes, under the same settings
-- where the tokenizer's settings differ from that call's (truncation or padding left
configured, special-token splitting on), or there is no Rust tokenizer, it is
``tokenizer.encode`` itself.
"""

from __future__ import annotations

from typing import Any

IDS_PER_SLICE = 1024


def encode_text(
    tokenizer: Any, text: str, *, add_special_tokens: bool, pair: str | None = None
) -> list[int]:
    """``tokenizer.encode(text, pair, add_special_tokens=...)``, GIL-friendly: with
    ``pair``, the two texts joined as the tokenizer joins a pair (a cross-encoder's
    query and document). Blocking: call it from a worker thread."""
    backend = _plain_backend(tokenizer)
    if backend is None:
        return list(tokenizer.encode(text, pair, add_special_tokens=add_special_tokens))
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    item = text if pair is None else (text, pair)
    (encoding,) = encode([item], add_special_tokens=add_special_tokens)
    if len(encoding) <= IDS_PER_SLICE:
        ids: list[int] = encoding.ids
        return ids
    encoding.truncate(IDS_PER_SLICE)
    ids = encoding.ids
    for rest in encoding.overflowing:
        ids.extend(rest.ids)
    return ids


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind ``tokenizer`` when calling it directly gives exactly what
    ``tokenizer.encode`` gives; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers would switch those off first
    split_special = bool(getattr(tokenizer, "split_special_tokens", False))
    if getattr(backend, "encode_special_tokens", False) != split_special:
        return None
    return backend
