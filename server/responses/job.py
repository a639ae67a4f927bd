"""One response from request to stored result: the run's choice turned into output items
(server/responses/output.py), the response object, its stream, and its place in the
store (server/responses/store.py) and among the running jobs (for ``/cancel``).

``status``: ``completed``; ``incomplete`` with ``incomplete_details.reason =
"max_output_tokens"`` when the output was cut by the token limit; ``cancelled`` when
``/cancel`` (or a disconnect) aborted it; ``in_progress`` while it runs (``queued`` is
never reported: the engine takes a request at once or refuses it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.responses.output import ResponseOutput, Sequencer
from server.responses.protocol import ResponsesRequest, flat_name
from server.responses.state import ResponsesState
from server.responses.store import StoredResponse
from server.responses.translate import call_names
from server.routes.generation import ChoiceUpdate, GenerationRun
from server.routes.streaming import named_sse
from server.tools.output import ChoiceOutput, choice_output


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseJob:
    """A submitted run and everything its response reports."""

    def __init__(
        self,
        state: ResponsesState,
        run: GenerationRun,
        chat: Any,  # server.routes.chat.PreparedChat
        body: ResponsesRequest,
        model: str,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.state = state
        self.run = run
        self.body = body
        self.model = model
        self.conversation = conversation
        self.created_at = int(time.time())
        self.output = ResponseOutput(Sequencer(), call_names(body))
        self._choice: ChoiceOutput = choice_output(chat.plan, chat.reasoning)
        self.status = "in_progress"
        self.cancelled = False
        self.deleted = False  # DELETE while running: never stored again
        self._finish_reason: str | None = None

    @property
    def id(self) -> str:
        return self.run.request_id

    # ------------------------------------------------------------------ running
    async def collect(self) -> dict[str, Any]:
        """Run to the end; the final response (stored when the request asked)."""
        self.state.running[self.id] = self
        try:
            async for update in self.run:
                self.output.feed(self._events(update))
        finally:
            self.state.running.pop(self.id, None)
        self._end()
        return self.response()

    async def stream(self) -> AsyncIterator[str]:
        """The typed event sequence, ``response.created`` to ``response.completed`` (or
        ``.incomplete``)."""
        self.state.running[self.id] = self
        seq = self.output.seq
        try:
            yield self._sse(seq.event("response.created", response=self.response()))
            yield self._sse(seq.event("response.in_progress", response=self.response()))
            async for update in self.run:
                for event in self.output.feed(self._events(update)):
                    yield self._sse(event)
        finally:
            self.state.running.pop(self.id, None)
        for event in self._end():
            yield self._sse(event)
        final = "response.incomplete" if self.status == "incomplete" else "response.completed"
        yield self._sse(seq.event(final, response=self.response()))

    def start_background(self) -> dict[str, Any]:
        """Run without a client waiting; the in-progress response, stored at once."""
        self.store_now()
        task = asyncio.ensure_future(self._background())
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)
        return self.response()

    async def _background(self) -> None:
        try:
            await self.collect()
        finally:
            self.run.close()

    def cancel(self) -> None:
        """Abort the run (``/cancel``); its response ends ``cancelled``."""
        self.cancelled = True
        self.run.close()

    def delete(self) -> None:
        """Abort the run and keep its end out of the store (``DELETE`` while running)."""
        self.deleted = True
        self.cancel()

    # ------------------------------------------------------------------ results
    def _events(self, update: ChoiceUpdate) -> list[Any]:
        events = self._choice.feed(update.text)
        if update.finish_reason is not None:
            events += self._choice.finish()
            self._finish_reason = update.finish_reason
        return events

    def _end(self) -> list[dict[str, Any]]:
        """Close the output; set the status; store the response. The closing events."""
        if self.cancelled or self._finish_reason in (None, "abort"):
            self.status = "cancelled"
        elif self._finish_reason == "length":
            self.status = "incomplete"
        else:
            self.status = "completed"
        item_status = "incomplete" if self.status != "completed" else "completed"
        events = self.output.finish(item_status)
        if self.body.store and not self.deleted:
            self.store_now()
        return events

    def store_now(self) -> None:
        messages = [*self.conversation, *self._output_messages()]
        items = (
            [_item_json(item) for item in self.body.input]
            if isinstance(self.body.input, list)
            else [{"type": "message", "role": "user", "content": self.body.input}]
        )
        self.state.store.put(StoredResponse(self.response(), messages, items))

    def _output_messages(self) -> list[dict[str, Any]]:
        """This response's output as the chat messages a continuation sends back."""
        reasoning = "".join(
            part["text"]
            for item in self.output.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {
                    "name": flat_name(item.get("namespace"), item["name"]),
                    "arguments": item["arguments"],
                },
            }
            for item in self.output.items
            if item["type"] == "function_call"
        ]
        text = self.output.text
        if not (text or calls or reasoning):
            return []
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        elif not text:
            message["content"] = ""
        if reasoning:
            message["reasoning"] = reasoning
        return [message]

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": body.background,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": list(self.output.items),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": body.reasoning.effort if body.reasoning else None,
                "summary": None,
            },
            "store": body.store,
            "temperature": body.temperature,
            "text": _text_config(body),
            "tool_choice": _tool_choice(body),
            "tools": [
                tool.model_dump(by_alias=True, exclude_none=True) for tool in body.tools or ()
            ],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": self._usage() if self.status != "in_progress" else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def _usage(self) -> dict[str, Any]:
        usage = self.run.usage()
        tokenizer = self.run.ctx.tokenizer
        reasoning = "".join(
            part["text"]
            for item in self.output.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        reasoning_tokens = (
            len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": min(reasoning_tokens, usage["completion_tokens"])
            },
            "total_tokens": usage["total_tokens"],
        }

    @staticmethod
    def _sse(event: dict[str, Any]) -> str:
        return named_sse(event["type"], event)


def _item_json(item: Any) -> dict[str, Any]:
    return item.model_dump(by_alias=True, exclude_none=True)


def _text_config(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
