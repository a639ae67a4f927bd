"""The adapters a server serves, by name: the ``--lora-modules`` given at start and those
loaded at run time. Thread-safe: the routes read it on the event loop, loads and unloads
run off it (``load`` reads files), the engine thread never needs it (each request carries
its ``LoRARequest``).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import torch

from engine.lora.adapter import LoRAError, read_adapter
from engine.lora.targets import LoRATargets
from engine.request import LoRARequest


class LoRACatalog:
    """Names to ``LoRARequest``s; ids are never reused, so a reload is a new adapter."""

    def __init__(self, targets: LoRATargets, dtype: torch.dtype) -> None:
        self.targets = targets
        self.dtype = dtype
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at ``path`` against the base and serve it as ``name``
        (``LoRAError`` if it cannot be, or the name is taken). Reads every file: slow."""
        if not name or "," in name or name != name.strip():
            # The gateway's lora_requests_info lists adapters comma-separated.
            raise LoRAError(
                f"LoRA adapter name {name!r} must be non-empty, without commas or "
                "surrounding spaces"
            )
        with self._lock:
            if name in self._adapters:
                raise LoRAError(f"the LoRA adapter {name!r} is already loaded")
        # Raises what the runner would; its fingerprint keys the adapter's prefix blocks.
        digest = read_adapter(path, self.targets, self.dtype).fingerprint
        with self._lock:
            if name in self._adapters:
                raise LoRAError(f"the LoRA adapter {name!r} is already loaded")
            lora = LoRARequest(name, next(self._ids), str(Path(path).resolve()), digest)
            self._adapters[name] = lora
            return lora

    def unload(self, name: str) -> LoRARequest:
        """Stop serving ``name``; KeyError when it is not loaded."""
        with self._lock:
            return self._adapters.pop(name)

    def get(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        with self._lock:
            return self._adapters.get(name)

    def adapters(self) -> tuple[LoRARequest, ...]:
        """Every served adapter, in load order."""
        with self._lock:
            return tuple(self._adapters.values())
