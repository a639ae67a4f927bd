"""Load-test configuration: small frozen dataclasses, validated on construction.

Lengths of user messages are counted in words drawn from a list of common short English
words; with the BPE tokenizers of current chat models one such word is about one token,
so ``--user-len 64`` asks for a user turn of roughly 64 prompt tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

LengthKind = Literal["fixed", "uniform", "lognormal"]
LENGTH_KINDS: tuple[str, ...] = ("fixed", "uniform", "lognormal")
RoutingMode = Literal["conversation", "request"]
ROUTING_MODES: tuple[str, ...] = ("conversation", "request")


def server_root(url: str) -> str:
    """The server root of a URL: a trailing ``/`` or ``/v1`` is dropped."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class LengthDist:
    """Length of each new user message, in words.

    ``fixed``: always ``mean``. ``uniform``: integers in ``[mean - spread, mean + spread]``.
    ``lognormal``: median ``mean`` with log-space standard deviation ``spread``.
    """

    kind: LengthKind = "fixed"
    mean: int = 64
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, not {self.kind!r}")
        if self.mean < 1:
            raise ValueError("length mean must be >= 1")
        if self.spread < 0:
            raise ValueError("length spread must be >= 0")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            low = max(1, self.mean - int(self.spread))
            return rng.randint(low, self.mean + int(self.spread))
        if self.kind == "lognormal":
            return max(1, round(rng.lognormvariate(math.log(self.mean), self.spread)))
        return self.mean

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """Parse ``64``, ``uniform:64:32`` or ``lognormal:64:0.5``."""
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if len(parts) == 3 and parts[0] in ("uniform", "lognormal"):
                return cls(parts[0], int(parts[1]), float(parts[2]))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"bad length {text!r}: {exc}") from exc
        raise ValueError(
            f"bad length {text!r}: use N, uniform:MEAN:HALF_WIDTH or lognormal:MEDIAN:SIGMA"
        )

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.mean)
        return f"{self.kind}:{self.mean}:{self.spread:g}"


@dataclass(frozen=True)
class SLO:
    """Service-level objective for goodput: a request is good when it succeeded, its time
    to first token is at most ``ttft_s`` and its mean inter-token latency at most ``itl_s``."""

    ttft_s: float = 1.2
    itl_s: float = 0.2

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError("SLO bounds must be positive")


@dataclass(frozen=True)
class LoadTestConfig:
    """One load-test run.

    Closed loop (default): ``concurrency`` conversations run at once; each of ``turns``
    requests re-sends the whole history plus a new user message, and a finished
    conversation is replaced by a new one until ``num_conversations`` have started.
    Poisson mode (``request_rate`` set): requests arrive at that mean rate; each arrival
    takes the next turn of an idle conversation or opens a new one (at most
    ``concurrency`` open at once; beyond that the arrival waits for one to become idle).
    The run ends at the first of: all conversations done, ``max_requests`` sent,
    ``duration_s`` elapsed (in-flight requests then get ``drain_timeout_s`` to finish).

    Several replicas: ``urls`` (two or more) drives them directly, ``url`` is then unused;
    ``routing`` "conversation" pins conversation ``i`` to ``urls[i % N]`` (round-robin
    assignment, so a conversation's history stays in one replica's prefix cache),
    "request" sends each request to the next URL in turn. ``replica_urls`` names the
    replicas behind a router (``url``); their ``/metrics`` give the per-replica figures.
    Without ``replica_urls`` a direct multi-URL run scrapes its ``urls``.
    """

    url: str = "http://127.0.0.1:8000"
    urls: tuple[str, ...] = ()
    routing: RoutingMode = "conversation"
    replica_urls: tuple[str, ...] = ()
    model: str | None = None
    # Several model names (LoRA adapters of one base, say): conversation ``i`` talks to
    # ``models[i % N]``; empty: every conversation uses ``model``.
    models: tuple[str, ...] = ()
    api_key: str | None = None
    concurrency: int = 8
    turns: int = 4
    num_conversations: int | None = None  # None: one conversation per concurrency slot
    request_rate: float | None = None  # requests/s; None: closed loop
    user_len: LengthDist = field(default_factory=LengthDist)
    system_prompt_len: int = 0  # words of a system prompt shared by every conversation
    max_tokens: int = 64
    ignore_eos: bool = False
    temperature: float = 0.0
    think_time_s: float = 0.0
    ramp_up_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    scrape_interval_s: float = 1.0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)

    def __post_init__(self) -> None:
        for url in (self.url, *self.urls, *self.replica_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url must start with http:// or https://, not {url!r}")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, not {self.routing!r}")
        positive = {"concurrency": self.concurrency, "turns": self.turns}
        positive["max_tokens"] = self.max_tokens
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_conversations is not None and self.num_conversations < 1:
            raise ValueError("num_conversations must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        for name in ("think_time_s", "ramp_up_s", "system_prompt_len", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.scrape_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("scrape interval and request timeout must be > 0")

    @property
    def target_urls(self) -> tuple[str, ...]:
        """The server roots requests go to: ``urls`` when given, else ``url``."""
        return tuple(server_root(u) for u in self.urls) or (server_root(self.url),)

    @property
    def base_url(self) -> str:
        """The (first) server root: a trailing ``/`` or ``/v1`` in the URL is dropped."""
        return self.target_urls[0]

    @property
    def scraped_replicas(self) -> tuple[str, ...]:
        """Server roots whose ``/metrics`` give per-replica figures: ``replica_urls``, or
        the targets of a direct run over several URLs, else none."""
        if self.replica_urls:
            return tuple(server_root(u) for u in self.replica_urls)
        return self.target_urls if len(self.target_urls) > 1 else ()

    @property
    def total_conversations(self) -> int:
        return self.num_conversations if self.num_conversations is not None else self.concurrency

    @property
    def request_limit(self) -> int:
        """Most requests the run can send."""
        natural = self.total_conversations * self.turns
        return min(natural, self.max_requests) if self.max_requests is not None else natural
