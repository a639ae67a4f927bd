"""The disk tier's entry format (engine/kv/disk_store.py): packing and checking one file.

File format (version ``FORMAT_VERSION``)::

    bytes [0, 8)        magic b"KVSBLK01"
    bytes [8, 512)      JSON header, space-padded: format, the configuration fingerprint
                        (model, dtype, KV dtype, block size, layer/head shape), the block's
                        hash, payload length and a BLAKE2b checksum of the payload
    bytes [512, ...)    payload: the block's K, V (and scale) bytes, as the runner packs them

An entry is usable only when its header names the running configuration, its hash is the
one asked for, its length is right and its checksum matches; the checks here say which of
``REJECT_REASONS`` failed, and the store decides what to do about it. Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from hashlib import blake2b

from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES
from engine.kv.block_pool import BlockHash

FORMAT_VERSION = 1
MAGIC = b"KVSBLK01"
_CHECKSUM_BYTES = 16
# Why an entry was rejected: "fingerprint" is another configuration's entry (sound, not
# ours), every other reason a damaged one.
REJECT_REASONS = ("empty", "truncated", "oversized", "header", "checksum", "fingerprint")


@dataclass(frozen=True)
class DiskFingerprint:
    """What must match for a stored block to be usable by the running engine."""

    model: str
    dtype: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # A hybrid model's KV groups (layers and window of each: a block holds one group's
    # layers); empty for one group of every layer, so such entries read as before.
    kv_groups: str = ""

    def as_dict(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "model": self.model,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        if self.kv_groups:
            fields["kv_groups"] = self.kv_groups
        return fields


def pack_entry(fingerprint: DiskFingerprint, block_hash: BlockHash, payload: bytes) -> bytes:
    """Header and payload, as one file's bytes; ValueError when the header does not fit."""
    fields = {
        "format": FORMAT_VERSION,
        **fingerprint.as_dict(),
        "hash": block_hash.hex(),
        "payload_bytes": len(payload),
        "checksum": _checksum(payload),
    }
    text = json.dumps(fields, separators=(",", ":")).encode()
    room = DISK_ENTRY_HEADER_BYTES - len(MAGIC)
    if len(text) > room:
        raise ValueError(f"disk tier header of {len(text)} bytes exceeds {room}")
    return MAGIC + text.ljust(room) + payload


def check_entry(
    fingerprint: DiskFingerprint, data: bytes, block_hash: BlockHash
) -> tuple[bytes, str | None]:
    """(payload, None) for a sound entry of ``block_hash``, else (b"", the reason)."""
    head = data[:DISK_ENTRY_HEADER_BYTES]
    fields, reason = check_header(fingerprint, head, block_hash.hex(), len(data))
    if reason is not None:
        return b"", reason
    payload = data[DISK_ENTRY_HEADER_BYTES:]
    if _checksum(payload) != fields.get("checksum"):
        return b"", "checksum"
    return payload, None


def check_header(
    fingerprint: DiskFingerprint, head: bytes, name: str, size: int
) -> tuple[dict[str, object], str | None]:
    """(fields, None) when the header is sound, belongs to the entry named ``name`` (its
    hash in hex) and to ``fingerprint``, and the file's ``size`` is the one it declares;
    else the fields read and the reason (the payload's checksum is not checked here)."""
    if not head:
        return {}, "empty"
    if len(head) < DISK_ENTRY_HEADER_BYTES:
        return {}, "truncated"
    fields = _read_header(head)
    if fields is None or fields.get("hash") != name or not is_hex(name):
        return {}, "header"
    if fields.get("format") != FORMAT_VERSION or any(
        fields.get(key) != value for key, value in fingerprint.as_dict().items()
    ):
        return fields, "fingerprint"
    declared = fields.get("payload_bytes")
    if not isinstance(declared, int):
        return {}, "header"
    expected = DISK_ENTRY_HEADER_BYTES + declared
    if size != expected:
        return fields, "truncated" if size < expected else "oversized"
    return fields, None


def is_hex(name: str) -> bool:
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return True


def _read_header(head: bytes) -> dict[str, object] | None:
    """The header's fields when it has the magic and a JSON object; else None."""
    if not head.startswith(MAGIC):
        return None
    try:
        fields = json.loads(head[len(MAGIC) :].decode().rstrip())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return fields if isinstance(fields, dict) else None


def _checksum(payload: bytes) -> str:
    return blake2b(payload, digest_size=_CHECKSUM_BYTES).hexdigest()
