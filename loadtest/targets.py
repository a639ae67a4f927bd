"""Which server root each request of a run goes to (one URL, a router, or several
replicas driven directly)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from loadtest.config import RoutingMode


class TargetPicker:
    """Chooses a request's server root among ``targets``.

    ``conversation``: conversation ``i`` always goes to ``targets[i % N]`` (conversations
    are assigned round-robin and pinned, as a session-affine balancer would).
    ``request``: each request goes to the next target in turn, whatever its conversation
    (a balancer that ignores prefixes). With one target both modes send everything there.
    """

    def __init__(self, targets: tuple[str, ...], routing: RoutingMode) -> None:
        if not targets:
            raise ValueError("at least one target URL is needed")
        self.targets = targets
        self.routing = routing
        self._cycle: Iterator[str] = itertools.cycle(targets)

    def pick(self, conversation_id: int) -> str:
        """The server root the conversation's next request goes to."""
        if self.routing == "request":
            return next(self._cycle)
        return self.targets[conversation_id % len(self.targets)]
