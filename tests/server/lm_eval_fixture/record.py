"""Run lm-evaluation-harness's ``local-completions`` model against a live kvserve and record
what it sent and what it concluded, for ``test_lm_eval_replay.py``.

Why a recording: lm-eval (0.4.13) pulls ~40 packages (datasets, pyarrow, pandas, scipy,
scikit-learn, evaluate, peft, ...) into the environment; CI installs only the dev extra,
so the test replays lm-eval's requests against the server instead and checks the
answers give lm-eval's own loglikelihoods. Re-record (needs ``pip install lm-eval==0.4.13``):

    python -m tests.server.lm_eval_fixture.record

from the repository root. Uses the same tiny random Llama the server tests build (seeded),
the local task ``kvserve_tiny.yaml`` and its jsonl; no hub access.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RECORDING = HERE / "recording.json"


def build_tiny_model_dir(root: Path) -> Path:
    """The ``tiny_model_dir`` fixture's model, outside pytest."""
    from transformers import AutoTokenizer

    from tests.conftest import smollm_gguf_path, tiny_llama_config, tiny_llama_model

    gguf = smollm_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = tiny_llama_config(vocab_size=len(tokenizer), tie_embeddings=True)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.eos_token_id
    tiny_llama_model(config, seed=1234).save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root


class Recorder:
    """ASGI wrapper keeping the JSON bodies of POST /v1/completions."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[dict[str, Any]] = []
        self.responses: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        messages = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        self.bodies.append(json.loads(b"".join(m.get("body", b"") for m in messages)))
        chunks: list[bytes] = []

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        async def keep(message: Any) -> None:
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, replay, keep)
        self.responses.append(json.loads(b"".join(chunks)))


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    import uvicorn  # noqa: F401  (live_server needs it)

    from server.app import build_app
    from server.settings import ServerSettings
    from tests.server import conftest

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "tiny")
        built = conftest.build_tiny(model_dir)
        recorder_box: list[Recorder] = []

        def recording_app(ctx: Any) -> Any:
            recorder_box.append(Recorder(build_app(ctx)))
            return recorder_box[0]

        conftest.build_app = recording_app  # type: ignore[attr-defined]
        settings = ServerSettings(served_model_names=(conftest.TINY_MODEL_NAME,))
        task_dir = Path(tmp) / "tasks"
        task_dir.mkdir()
        task = (HERE / "kvserve_tiny.yaml").read_text()
        data = str(HERE / "tiny_choices.jsonl")
        (task_dir / "kvserve_tiny.yaml").write_text(task.replace("tiny_choices.jsonl", data))
        with conftest.live_server(built, settings) as live:
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(
                    f"base_url={live.v1}/completions,model={conftest.TINY_MODEL_NAME},"
                    f"tokenizer_backend=huggingface,tokenizer={model_dir},num_concurrent=1"
                ),
                tasks=["kvserve_tiny"],
                task_manager=lm_eval.tasks.TaskManager(include_path=str(task_dir)),
                log_samples=True,
                random_seed=0,
            )
    assert results is not None
    samples = [
        {
            "doc": s["doc"],
            "arguments": [list(a) for a in s["arguments"]],
            "loglikelihoods": [[float(r[0][0]), bool(r[0][1])] for r in s["resps"]],
        }
        for s in results["samples"]["kvserve_tiny"]
    ]
    recording = {
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4.13",
        "requests": recorder_box[0].bodies,
        "responses": recorder_box[0].responses,
        "samples": samples,
        "acc": results["results"]["kvserve_tiny"]["acc,none"],
    }
    RECORDING.write_text(json.dumps(recording, indent=1) + "\n")
    print(f"recorded {len(recording['requests'])} requests, {len(samples)} samples")


if __name__ == "__main__":
    main()
