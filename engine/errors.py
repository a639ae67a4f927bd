"""Engine-side errors that the server maps onto HTTP statuses."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine will never run. ``reason`` is a stable label for metrics
    (``too_long``, ``no_capacity``, ``queue_full``); the message tells the user what to
    change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can make progress until restart."""


class GrammarError(ValueError):
    """A structured-output constraint (JSON schema, regex, choice, grammar) that cannot be
    compiled; the message says what is wrong in it (the server answers 400)."""


class AdapterUnavailable(RuntimeError):
    """A LoRA adapter a step needs could not be read back from its directory (deleted, or
    its files changed since it was loaded). Only the requests on adapter ``lora_id`` fail;
    the rest of the step runs (engine/step_executor.py)."""

    def __init__(self, lora_id: int, message: str) -> None:
        super().__init__(message)
        self.lora_id = lora_id
