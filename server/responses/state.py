"""The server's Responses API state: the store of finished responses and the jobs running.

Below both the routes' context (server/routes/context.py holds one per app) and the jobs
(server/responses/job.py registers itself here while it runs), so neither imports the
other: a running job is seen here only through ``RunningResponse``, what the routes ask of
it (``ResponseJob`` is the one implementation).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.responses.store import ResponseStore


class RunningResponse(Protocol):
    """What the routes do with a response still running (server/routes/responses.py)."""

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        ...

    def cancel(self) -> None:
        """Abort its run; it ends ``cancelled``."""
        ...

    def delete(self) -> None:
        """Never store its end (DELETE while it runs)."""
        ...


@dataclass
class ResponsesState:
    """The server's responses: the store, and the jobs still running (by id)."""

    store: ResponseStore = field(default_factory=ResponseStore)
    running: dict[str, RunningResponse] = field(default_factory=dict)
    # Background jobs' tasks, kept so they are not garbage-collected mid-run.
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
