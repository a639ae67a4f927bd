"""``n > 1`` groups: the sequences of one client request, and the fork that starts them.

A group's sequences share the prompt (indices 0..n-1). Only index 0 is scheduled at
first; the others wait here, unforked, until its prompt is computed, then share all its
blocks (copy-on-write, ``KVCacheManager.fork``) and recompute only the last prompt token
before sampling their own first one. A group is forgotten once every member finished.
"""

from __future__ import annotations

from engine.kv.manager import KVCacheManager
from engine.request import Request, RequestStatus


class SequenceGroups:
    """Live groups by id, and the children each has not forked yet."""

    def __init__(self) -> None:
        self.members: dict[str, list[Request]] = {}  # group id -> live members
        self.unforked: dict[str, list[Request]] = {}  # group id -> children not yet forked

    def validate(self, group: list[Request], live: dict[str, Request]) -> None:
        """Programming errors of the caller, not user input: fail loudly."""
        if not group:
            raise ValueError("add_request needs at least one request")
        parent = group[0]
        for index, request in enumerate(group):
            if request.index != index or request.group_id != parent.group_id:
                raise ValueError(f"group {parent.group_id!r}: indices must be 0..n-1, one group")
            if request.prompt_token_ids != parent.prompt_token_ids:
                raise ValueError(f"group {parent.group_id!r}: sequences must share the prompt")
            if request.request_id in live:
                raise ValueError(f"request id {request.request_id!r} is already live")
        if parent.group_id in self.members:
            raise ValueError(f"group id {parent.group_id!r} is already live")

    def add(self, group: list[Request]) -> None:
        """Register a validated group, sorted by index; its children start unforked."""
        self.members[group[0].group_id] = group
        if len(group) > 1:
            self.unforked[group[0].group_id] = group[1:]

    def pop(self, group_id: str) -> tuple[list[Request], list[Request]] | None:
        """Forget a group: its members and its unforked children; None when unknown."""
        members = self.members.pop(group_id, None)
        if members is None:
            return None
        return members, self.unforked.pop(group_id, [])

    def num_unforked(self, group_id: str) -> int:
        return len(self.unforked.get(group_id, ()))

    def total_unforked(self) -> int:
        return sum(len(children) for children in self.unforked.values())

    def drop_unforked(self, request: Request) -> bool:
        """Remove one unforked child (aborted before its fork); False when it is not one."""
        children = self.unforked.get(request.group_id)
        if not children or request not in children:
            return False
        children.remove(request)
        if not children:
            del self.unforked[request.group_id]
        return True

    def fork_children(self, parent: Request, kv: KVCacheManager, running: list[Request]) -> None:
        """The parent's prompt is computed: each child shares all its blocks, recomputes
        only the last prompt token, then samples its own first token."""
        assert parent.num_computed_tokens >= parent.num_prompt_tokens
        for child in self.unforked.pop(parent.group_id):
            kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            child.status = RequestStatus.RUNNING
            running.append(child)

    def forget_if_done(self, group_id: str) -> None:
        members = self.members.get(group_id)
        if members is not None and all(r.is_finished for r in members):
            del self.members[group_id]
