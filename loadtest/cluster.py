"""kvserve replicas behind vllm-router on one machine, as subprocesses on free ports.

Each replica publishes its KV cache events (``--kv-events-config``, ZMQ PUB plus the
replay ROUTER socket) on ports of its own; the router is given every replica as a worker
and, under ``kv_aware``, every replica's event and replay endpoints. Everything started
here is stopped on leaving ``ReplicaGroup`` and ``Router`` (SIGTERM, then SIGKILL after a
grace period), also when the body raised. One group of replicas can serve several routers
in turn (a policy each). vllm-router is not a dependency of kvserve: pass its binary
(``pip install vllm-router`` in a venv of its own).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 40.0  # past kvserve's own 30 s drain window
ROUTER_POLICIES: tuple[str, ...] = ("kv_aware", "cache_aware", "round_robin")


def free_port() -> int:
    """A port nobody listens on now (the OS's pick; a later bind may still race)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Managed:
    """A started subprocess and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; the exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def _start(name: str, command: Sequence[str], log: Path, env: dict[str, str]) -> Managed:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(list(command), stdout=sink, stderr=subprocess.STDOUT, env=env)
    return Managed(name, process, log)


def wait_http(managed: Managed, url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until ``GET url`` answers 200; RuntimeError with the log if the process died
    or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not managed.alive():
            raise RuntimeError(
                f"{managed.name} exited {managed.process.returncode}:\n" + managed.log_tail()
            )
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{managed.name} not ready after {timeout_s:.0f} s:\n" + managed.log_tail())


@dataclass
class Replica:
    """One kvserve replica: its HTTP root and its KV-event endpoints."""

    index: int
    port: int
    event_port: int
    replay_port: int
    managed: Managed | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.event_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self, python: str, served_name: str, extra: Sequence[str]) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
        }
        return [
            python, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port",
            str(self.port), "--served-model-name", served_name,
            "--kv-events-config", json.dumps(events), *extra,
        ]  # fmt: skip


@dataclass
class ReplicaGroup:
    """``count`` kvserve replicas started at once (``with ReplicaGroup(...) as group``):
    ``args`` is appended to every command (e.g. ``--model``); each runs with
    ``OMP_NUM_THREADS=threads`` since the replicas share the machine's cores."""

    count: int = 2
    served_name: str = "SmolLM2-135M-Instruct"
    args: tuple[str, ...] = ()
    log_dir: Path = Path("cluster-logs")
    python: str = sys.executable
    threads: int = 1
    replicas: list[Replica] = field(default_factory=list)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(r.url for r in self.replicas)

    def __enter__(self) -> ReplicaGroup:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every replica, then wait for each one's /health."""
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        for index in range(self.count):
            replica = Replica(index, free_port(), free_port(), free_port())
            command = replica.command(self.python, self.served_name, self.args)
            log = self.log_dir / f"replica-{index}.log"
            replica.managed = _start(f"replica {index}", command, log, env)
            self.replicas.append(replica)
        for replica in self.replicas:
            assert replica.managed is not None
            wait_http(replica.managed, f"{replica.url}/health")

    def stop(self) -> None:
        """SIGTERM every replica still running (SIGKILL after the grace period)."""
        for replica in self.replicas:
            if replica.managed is not None:
                replica.managed.stop()


@dataclass
class Router:
    """vllm-router in front of ``replicas`` with ``policy`` (``with Router(...)``).

    Under ``kv_aware`` it subscribes to every replica's events and replay sockets;
    ``served_name`` must be the replicas' served model name. ``args`` is appended.
    """

    binary: str
    replicas: Sequence[Replica]
    policy: str = "kv_aware"
    served_name: str = "SmolLM2-135M-Instruct"
    block_size: int = 16
    args: tuple[str, ...] = ()
    log: Path = Path("cluster-logs/router.log")
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    managed: Managed | None = None

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"policy must be one of {ROUTER_POLICIES}, not {self.policy!r}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        command = [
            self.binary, "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-port", str(self.metrics_port), "--policy", self.policy,
            "--worker-urls", *(r.url for r in self.replicas),
        ]  # fmt: skip
        if self.policy == "kv_aware":
            command += ["--kv-event-model", self.served_name]
            command += ["--kv-event-block-size", str(self.block_size)]
            for replica in self.replicas:
                command += ["--kv-event-source", f"{replica.url}={replica.events}"]
                command += ["--kv-event-replay-source", f"{replica.url}={replica.replay}"]
        return command + list(self.args)

    def __enter__(self) -> Router:
        self.managed = _start("vllm-router", self.command(), self.log, dict(os.environ))
        try:
            wait_http(self.managed, f"{self.url}/v1/models", timeout_s=60.0)
        except BaseException:
            self.managed.stop(grace_s=10.0)
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.managed is not None:
            self.managed.stop(grace_s=10.0)
