"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and, for the first block only,
an optional extra key (the request's cache salt). Equal hashes therefore mean equal whole
prefixes, so a hit on block ``i`` implies hits on blocks ``0..i-1`` as well. BLAKE2b with
a 128-bit digest makes accidental collisions negligible (unlike Python's ``hash``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

from engine.kv.block_pool import BlockHash

DIGEST_SIZE = 16
_SALT_MARKER = b"\x00salt\x00"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra: str | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    digest = blake2b(digest_size=DIGEST_SIZE)
    if parent is not None:
        digest.update(parent)
    # Fixed-width encoding: every block of a pool has the same length, so the byte string
    # is unambiguous without separators.
    digest.update(array("q", token_ids).tobytes())
    if extra is not None:
        digest.update(_SALT_MARKER)
        digest.update(extra.encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_blocks: int,
    block_size: int,
    extra: str | None = None,
) -> None:
    """Append hashes to ``hashes`` until it covers the first ``num_blocks`` full blocks of
    ``token_ids`` (which must hold at least ``num_blocks * block_size`` tokens)."""
    for index in range(len(hashes), num_blocks):
        start = index * block_size
        parent = hashes[index - 1] if index else None
        hashes.append(
            hash_block(parent, token_ids[start : start + block_size], None if index else extra)
        )
