"""Live kvserve servers for the HTTP tests: real uvicorn on 127.0.0.1, random port,
serving the tiny random Llama from ``tiny_model_dir`` (one server per configuration)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineArgs
from server.app import build_app, serving_context
from server.routes.context import ServingContext
from server.settings import ServerSettings

TINY_MODEL_NAME = "tiny-llama"
TINY_MAX_MODEL_LEN = 1024
TINY_NUM_BLOCKS = 512


@dataclass
class LiveServer:
    url: str
    ctx: ServingContext
    built: Any
    app: Any = None  # the FastAPI app (its state holds e.g. the block-map hub)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def wait_idle(self, timeout_s: float = 10.0) -> Any:
        """Wait until the engine holds no request and no used block; return the stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.ctx.engine.stats()
            idle = stats.num_running + stats.num_waiting + stats.num_swapped == 0
            if idle and stats.device_blocks.used == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout_s}s: {stats}")
            time.sleep(0.02)


def tiny_engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    defaults: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": TINY_MAX_MODEL_LEN,
        "num_kv_blocks": TINY_NUM_BLOCKS,
        "block_size": 16,
        "swap_space_gib": 0.01,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 1024,
    }
    defaults.update(overrides)
    return EngineArgs(**defaults)


@contextmanager
def live_server(built: Any, settings: ServerSettings) -> Iterator[LiveServer]:
    """Run uvicorn in a thread on a pre-bound 127.0.0.1 socket; stop it on exit."""
    import uvicorn

    from server.http_server import uvicorn_config

    ctx = serving_context(built, settings)
    app = build_app(ctx)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # The CLI's configuration (the header-read timeout included), quieter and quicker.
    config = uvicorn_config(
        app, settings, ctx.count_rejected, log_level="warning", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", ctx, built, app)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def build_tiny(model_dir: Path, **overrides: Any) -> Any:
    from engine.builder import build_engine

    return build_engine(tiny_engine_args(model_dir, **overrides))


@pytest.fixture(scope="session")
def tiny_built(tiny_model_dir: Path) -> Any:
    """One tiny engine shared by several servers. EngineCore is single-threaded: each
    server gets its own AsyncEngine thread, so a test must drive only one of them at a
    time (idle engine threads sleep and never touch the core)."""
    return build_tiny(tiny_model_dir)


@pytest.fixture(scope="session")
def server(tiny_built: Any) -> Iterator[LiveServer]:
    """The default server: no auth, the tiny model under the name ``tiny-llama``."""
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME, "alias"), max_n=8)
    with live_server(tiny_built, settings) as live:
        yield live


@pytest.fixture(scope="session")
def client(server: LiveServer) -> Any:
    import openai

    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def smollm_tools_server(smollm_gguf: Path) -> Iterator[LiveServer]:
    """The embedded SmolLM2 (float32, so no test depends on the CPU's bf16 support),
    served with tool_choice "auto" enabled through the hermes parser. Torch kernels: the
    API is under test here, not the fused kernels, and this keeps the fixture from waiting
    on their first compile."""
    from engine.builder import build_engine

    args = EngineArgs(
        model=str(smollm_gguf),
        device="cpu",
        dtype="float32",
        max_model_len=2048,
        num_kv_blocks=512,
        block_size=16,
        swap_space_gib=0.01,
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        kernels="torch",
    )
    settings = ServerSettings(
        served_model_names=("smollm2",),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with live_server(build_engine(args), settings) as live:
        yield live


@dataclass
class KvserveProcess:
    """A ``kvserve serve`` child process and its base URL."""

    process: Any
    url: str
    port: int


@contextmanager
def kvserve_process(
    model_dir: Path,
    *flags: str,
    startup_s: float = 180,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> Iterator[KvserveProcess]:
    """Run the real CLI (``python -m server.cli serve``) on a free 127.0.0.1 port with the
    tiny model and ``flags`` (after ``prefix``, e.g. a ``nice``); wait for ``/health``;
    kill it on exit if it is still up."""
    import os
    import subprocess
    import sys

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    command = [
        *prefix,
        *(sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir)),
        *("--device", "cpu", "--dtype", "float32", "--max-model-len", str(TINY_MAX_MODEL_LEN)),
        *("--port", str(port), "--log-level", "warning", *flags),
    ]
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        command, cwd=root, env={**os.environ, "PYTHONPATH": str(root), **(env or {})}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    try:
        while True:
            assert process.poll() is None, "kvserve serve exited during start-up"
            assert time.monotonic() < deadline, "kvserve serve did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield KvserveProcess(process, url, port)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


# -- the agent-API servers (tests/server/agents.py) ----------------------------------------


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    from tests.server.agents import make_scripted_dir

    return make_scripted_dir(tmp_path_factory.mktemp("scripted"), smollm_tokenizer)


@pytest.fixture(scope="session")
def scripted_built(scripted_dir: Path) -> Any:
    from engine.builder import build_engine
    from tests.server.agents import scripted_args

    return build_engine(scripted_args(scripted_dir))


@pytest.fixture(scope="session")
def agent_server(scripted_built: Any) -> Iterator[LiveServer]:
    """The scripted model with --reasoning-parser qwen3 and hermes tool calls."""
    from tests.server.agents import agent_settings

    with live_server(scripted_built, agent_settings()) as live:
        yield live
