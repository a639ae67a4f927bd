"""Synthetic conversation content: reproducible user messages from a seed.

Words come from a list of common short English words, which current BPE tokenizers
encode as about one token each, so message lengths in words approximate prompt tokens.
Each conversation opens with its own tag, so two conversations never share a prefix by
accident; a shared system prompt (``system_prompt_len``) is the deliberate shared prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from loadtest.config import LengthDist

_WORD_LIST = """
    the of and to in is it you that he was for on are with as his they be at one have
    this from or had by word but what some we can out other were all there when up use
    your how said an each she which do their time if will way about many then them write
    would like so these her long make thing see him two has look more day could go come
    did number sound no most people my over know water than call first who may down side
    been now find any new work part take get place made live where after back little only
    round man year came show every good me give our under name very through just form
    sentence great think say help low line differ turn cause much mean before move right
    boy old too same tell does set three want air well also play small end put home read
    hand port large spell add even land here must big high such follow act why ask men
    change went light kind off need house picture try us again animal point mother world
    near build self earth father head stand own page should country found answer school
    grow study still learn plant cover food sun four between state keep eye never last let
    thought city tree cross farm hard start might story saw far sea draw left late run
"""
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())

SYSTEM_PROMPT_HEAD = "You are a patient assistant. Answer the user briefly. Notes:"


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def shared_system_prompt(num_words: int, seed: int) -> str | None:
    """The same system prompt for every conversation of a run (a shared prefix)."""
    if num_words <= 0:
        return None
    return f"{SYSTEM_PROMPT_HEAD} {random_words(random.Random(seed), num_words)}"


@dataclass
class Conversation:
    """One conversation's history; each turn appends a user message and the reply."""

    conversation_id: int
    turns_total: int
    user_len: LengthDist
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)
    turns_done: int = 0

    @classmethod
    def create(
        cls,
        conversation_id: int,
        *,
        turns: int,
        user_len: LengthDist,
        seed: int,
        system_prompt: str | None,
    ) -> Conversation:
        conversation = cls(
            conversation_id, turns, user_len, random.Random(f"{seed}:{conversation_id}")
        )
        if system_prompt is not None:
            conversation.messages.append({"role": "system", "content": system_prompt})
        return conversation

    @property
    def finished(self) -> bool:
        return self.turns_done >= self.turns_total

    def next_user_message(self) -> list[dict[str, str]]:
        """Append the next user message and return the full history to send."""
        words = random_words(self.rng, self.user_len.sample(self.rng))
        if self.turns_done == 0:
            words = f"[conversation {self.conversation_id}] {words}"
        self.messages.append({"role": "user", "content": words})
        return list(self.messages)

    def record_reply(self, text: str) -> None:
        """Append the assistant's reply (possibly empty) and count the turn as done."""
        self.messages.append({"role": "assistant", "content": text})
        self.turns_done += 1

    def abandon_turn(self) -> None:
        """A turn failed: drop its user message so a retry does not send it twice, and
        count the turn so that a broken server cannot keep a conversation alive forever."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.turns_done += 1
