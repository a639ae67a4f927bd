"""The real agent CLIs against ``kvserve serve``: Claude Code in print mode over the
Messages API and Codex CLI's ``exec`` over the Responses API, installed from npm in the
test setup (pinned versions, into a cache directory) and run offline against 127.0.0.1.

They serve the scripted model (tests/server/agents.py): its context fits their prompts
(Claude Code's system prompt and tools are ~12k tokens, Codex's ~9k) and it answers
"Hello". Each CLI must complete a turn, print the answer, and leave no request refused.
Codex's hosted web search (which no local server runs) is turned off in its config,
as docs/reference/api.md says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.agents import ANSWER, CONTEXT, MODEL
from tests.server.conftest import KvserveProcess, kvserve_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CLIS = {"claude": "@anthropic-ai/claude-code@2.1.328", "codex": "@openai/codex@0.169.0"}
CACHE = Path(os.environ.get("KVSERVE_AGENT_CLIS", Path.home() / ".cache" / "kvserve-agent-clis"))


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """The CLIs' executables, installed once per machine (npm, pinned)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed (apt-get install -y npm)")
    bins = {name: CACHE / "node_modules" / ".bin" / name for name in CLIS}
    if not all(path.exists() for path in bins.values()):
        CACHE.mkdir(parents=True, exist_ok=True)
        command = [npm, "install", "--prefix", str(CACHE), "--no-audit", "--no-fund"]
        subprocess.run([*command, *CLIS.values()], check=True, timeout=600, capture_output=True)
    return bins


@pytest.fixture(scope="module")
def agent_cli_server(scripted_dir: Path) -> Iterator[KvserveProcess]:
    flags = (
        *("--served-model-name", MODEL, "--max-model-len", str(CONTEXT)),
        *("--kv-cache-memory", "0.25", "--swap-space", "0", "--kernels", "torch"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        *("--reasoning-parser", "qwen3"),
    )
    with kvserve_process(scripted_dir, *flags) as server:
        yield server


def refused(server: KvserveProcess) -> float:
    """Requests the server refused so far (kvserve_requests_rejected_total, all reasons)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvserve_requests_rejected_total"
    )


def run_cli(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_claude_code_completes_a_turn(
    clis: dict[str, Path], agent_cli_server: KvserveProcess, tmp_path: Path
) -> None:
    env = {
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": agent_cli_server.url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(CONTEXT),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    before = refused(agent_cli_server)
    done = run_cli([str(clis["claude"]), "-p", "Say hello", "--model", MODEL], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSWER in done.stdout
    assert refused(agent_cli_server) == before, "a request of Claude Code was refused"


def test_codex_exec_completes_a_turn(
    clis: dict[str, Path], agent_cli_server: KvserveProcess, tmp_path: Path
) -> None:
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "kvserve"\n'
        'web_search = "disabled"\n'
        "[model_providers.kvserve]\n"
        'name = "kvserve"\n'
        f'base_url = "{agent_cli_server.url}/v1"\n'
        'wire_api = "responses"\n'
    )
    env = {"CODEX_HOME": str(home), "HOME": str(tmp_path)}
    before = refused(agent_cli_server)
    command = [str(clis["codex"]), "exec", "--skip-git-repo-check", "Say hello"]
    done = run_cli(command, env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSWER in done.stdout
    assert refused(agent_cli_server) == before, "a request of Codex was refused"
