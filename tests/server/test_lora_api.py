"""LoRA adapters over HTTP: ``model`` names an adapter, /v1/models lists them as vLLM does,
and POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time.

A tiny random Llama saved with SmolLM2's tokenizer and adapters made by peft with random,
non-zero A and B (ranks 8, 16 and 4, the last on q_proj and v_proj only). Greedy output
through an adapter must be transformers' with the adapter merged (``merge_and_unload``),
token for token; the base model's name must give the base's.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.config import LoRAConfig
from server.app import serving_context
from server.detokenize import IncrementalDetokenizer
from server.settings import ServerSettings
from tests.model.engine_helpers import reference_greedy
from tests.model.family_models import llama
from tests.model.test_family_serving import saved_model
from tests.server.conftest import LiveServer, build_tiny, live_server

peft = pytest.importorskip("peft")

BASE = "base-llama"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 16
NEW_TOKENS = 8
PROMPT = "Name three rivers of Europe and the seas they flow into."


@dataclass
class Adapters:
    """The saved base, adapter directories by name, and the merged references."""

    base: Path
    paths: dict[str, Path]
    references: dict[str | None, Any]
    tokenizer: Any
    _greedy: dict[tuple[str | None, tuple[int, ...]], list[int]] = field(default_factory=dict)

    def greedy(self, name: str | None, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        key = (name, tuple(prompt))
        if key not in self._greedy:
            self._greedy[key] = reference_greedy(self.references[name], prompt, n)
        return self._greedy[key][:n]

    def text(self, prompt: list[int], ids: list[int]) -> str:
        """What the server makes of ``ids`` after ``prompt`` (its own detokenizer)."""
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt)
        return detok.push(ids) + detok.flush()


def _peft_adapter(base: Any, path: Path, seed: int, **config: Any) -> Any:
    """Save a peft adapter with random A and B (B large enough to move the argmax) and
    return the merged reference."""
    torch.manual_seed(seed)
    lora_config = peft.LoraConfig(init_lora_weights=False, **config)
    model = peft.get_peft_model(copy.deepcopy(base), lora_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def _foreign_adapter(source: Path, path: Path) -> None:
    """``source`` re-keyed as if trained for a model with a fused ``query_key_value``
    (Falcon, GPT-NeoX): a module this Llama does not have."""
    from safetensors.torch import load_file, save_file

    path.mkdir()
    tensors = load_file(str(source / "adapter_model.safetensors"))
    renamed = {key.replace("q_proj", "query_key_value"): t for key, t in tensors.items()}
    save_file(renamed, str(path / "adapter_model.safetensors"))
    config = json.loads((source / "adapter_config.json").read_text())
    config["target_modules"] = ["query_key_value", "v_proj"]
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Adapters:
    root = tmp_path_factory.mktemp("lora")
    base = saved_model(llama, smollm_tokenizer, root / "base")
    references: dict[str | None, Any] = {None: base}
    paths: dict[str, Path] = {}
    specs = {
        "sql": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
        "poet": {"r": 16, "lora_alpha": 8, "target_modules": ALL},
        "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    }
    for seed, (name, spec) in enumerate(specs.items()):
        paths[name] = root / name
        references[name] = _peft_adapter(base, paths[name], 100 + seed, **spec)
    # Adapters kvserve must refuse, each for its own reason.
    paths["rank32"] = root / "rank32"
    _peft_adapter(base, paths["rank32"], 7, r=32, target_modules=["q_proj", "v_proj"])
    paths["foreign"] = root / "foreign"
    _foreign_adapter(paths["qv"], paths["foreign"])
    paths["malformed"] = root / "malformed"
    paths["malformed"].mkdir()
    (paths["malformed"] / "adapter_config.json").write_text("{'r': 8,")
    return Adapters(root / "base", paths, references, smollm_tokenizer)


@pytest.fixture(scope="module")
def lora_built(adapters: Adapters) -> Any:
    """Two adapter slots, two adapters in host memory, ``sql`` served from the start."""
    lora = LoRAConfig(
        max_loras=2,
        max_lora_rank=MAX_RANK,
        max_cpu_loras=2,
        modules=(("sql", str(adapters.paths["sql"])),),
    )
    return build_tiny(adapters.base, lora=lora, max_model_len=512)


@pytest.fixture(scope="module")
def server(lora_built: Any) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_names=(BASE,), allow_runtime_lora_updating=True)
    with live_server(lora_built, settings) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    import openai

    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt(adapters: Adapters) -> list[int]:
    return list(adapters.tokenizer.encode(PROMPT))


def load(server: LiveServer, name: str, path: Path | str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{server.v1}/load_lora_adapter", json=body, timeout=60)


def unload(server: LiveServer, name: str, **extra: Any) -> httpx.Response:
    body = {"lora_name": name, **extra}
    return httpx.post(f"{server.v1}/unload_lora_adapter", json=body, timeout=60)


def complete(client: Any, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> Any:
    return client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


# -- /v1/models ------------------------------------------------------------------------------


def test_models_list_adapters_as_vllm_does(
    server: LiveServer, client: Any, adapters: Adapters
) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {BASE, "sql"}
    sql = cards["sql"].model_dump()
    assert sql["root"] == str(adapters.paths["sql"].resolve())
    assert sql["parent"] == BASE
    assert sql["object"] == "model"
    assert cards[BASE].model_dump()["parent"] is None
    one = httpx.get(f"{server.v1}/models/sql").json()
    assert (one["id"], one["root"], one["parent"]) == ("sql", sql["root"], BASE)
    assert httpx.get(f"{server.v1}/models/nope").status_code == 404


# -- generation through adapters ---------------------------------------------------------------


def test_adapters_and_base_in_one_batch_match_the_merged_references(
    server: LiveServer, client: Any, adapters: Adapters, prompt: list[int]
) -> None:
    """The base, a served adapter and one loaded at run time, concurrently (one batch):
    each gives its merged reference's greedy tokens, and names itself in ``model``."""
    assert load(server, "qv", adapters.paths["qv"]).status_code == 200
    try:
        names = [None, "sql", "qv", "sql", None]
        with ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(lambda n: complete(client, n or BASE, prompt), names))
        for name, answer in zip(names, answers, strict=True):
            expected = adapters.text(prompt, adapters.greedy(name, prompt))
            assert answer.model == (name or BASE)
            assert answer.choices[0].text == expected, name
            assert answer.usage.completion_tokens == NEW_TOKENS
        texts = {name: a.choices[0].text for name, a in zip(names, answers, strict=True)}
        assert len({texts[None], texts["sql"], texts["qv"]}) == 3  # the adapters matter
    finally:
        unload(server, "qv")


def test_chat_responses_and_messages_run_the_adapter(
    server: LiveServer, client: Any, adapters: Adapters
) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": "sql", "messages": messages})
    chat_prompt = rendered.json()["tokens"]
    expected = adapters.text(chat_prompt, adapters.greedy("sql", chat_prompt))
    base_text = adapters.text(chat_prompt, adapters.greedy(None, chat_prompt))
    assert expected != base_text
    options = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=NEW_TOKENS, **options
    )
    assert chat.model == "sql"
    assert chat.choices[0].message.content == expected
    response = client.responses.create(
        model="sql", input=messages, max_output_tokens=NEW_TOKENS, **options
    )
    assert response.model == "sql"
    assert response.output_text == expected
    message = httpx.post(
        f"{server.v1}/messages",
        json={"model": "sql", "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0},
        timeout=60,
    ).json()
    assert message["model"] == "sql"
    text = message["content"][0]["text"]  # no ignore_eos here: EOS may end it sooner
    assert text and expected.startswith(text)


def test_an_unknown_model_is_404_naming_the_adapters(client: Any, prompt: list[int]) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as raised:
        complete(client, "no-such-adapter", prompt)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found"
    assert BASE in body["message"] and "sql" in body["message"]


@pytest.mark.parametrize("route", ["/v1/embeddings", "/v1/score"])
def test_routes_of_the_base_model_only_refuse_an_adapter(server: LiveServer, route: str) -> None:
    body: dict[str, Any] = {"model": "sql"}
    body.update({"input": "hi"} if route == "/v1/embeddings" else {"text_1": "a", "text_2": "b"})
    response = httpx.post(f"{server.url}{route}", json=body)
    assert response.status_code == 400
    assert "LoRA adapter" in error_of(response)["message"] and BASE in response.text


# -- load and unload ---------------------------------------------------------------------------


def test_load_use_unload(
    server: LiveServer, client: Any, adapters: Adapters, prompt: list[int]
) -> None:
    import openai

    loaded = load(server, "poet", adapters.paths["poet"])
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'poet' added successfully."
    assert "poet" in {card.id for card in client.models.list().data}
    answer = complete(client, "poet", prompt)
    assert answer.choices[0].text == adapters.text(prompt, adapters.greedy("poet", prompt))
    removed = unload(server, "poet", lora_int_id=12345)  # vLLM's field: the name decides
    assert removed.status_code == 200
    assert removed.text == "Success: LoRA adapter 'poet' removed successfully."
    assert "poet" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "poet", prompt)
    again = unload(server, "poet")
    assert again.status_code == 404
    assert "poet" in error_of(again)["message"]


@pytest.mark.parametrize(
    ("name", "path_key", "words"),
    [
        ("bad", "malformed", "not valid JSON"),
        ("big", "rank32", "exceeds --max-lora-rank 16"),
        ("fused", "foreign", "'query_key_value', which this base model does not have"),
        ("gone", "nowhere", "is not a directory"),
        ("sql", "qv", "already loaded"),  # a served adapter's name
        (BASE, "qv", "base model's served name"),
    ],
)
def test_adapters_that_cannot_be_served_are_400(
    server: LiveServer, adapters: Adapters, name: str, path_key: str, words: str
) -> None:
    path = adapters.paths.get(path_key, adapters.base.parent / path_key)
    response = load(server, name, path)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"
    listed = [card["id"] for card in httpx.get(f"{server.v1}/models").json()["data"]]
    assert listed.count(name) == (name in (BASE, "sql"))  # nothing new, nothing doubled


def test_empty_or_missing_fields_are_400(server: LiveServer) -> None:
    empty = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "", "lora_path": ""})
    assert empty.status_code == 400
    missing = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and error_of(missing)["param"] == "lora_path"


def test_unload_while_a_stream_runs_is_409_then_200(
    server: LiveServer, adapters: Adapters, prompt: list[int]
) -> None:
    assert load(server, "busy", adapters.paths["qv"]).status_code == 200
    body = {
        "model": "busy",
        "prompt": prompt,
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "busy"
        refused = unload(server, "busy")
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert refused.status_code == 409, refused.text
    assert "in use by 1 running request" in error_of(refused)["message"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert unload(server, "busy").status_code == 200


def test_load_and_unload_under_traffic_lose_no_request(
    server: LiveServer, client: Any, adapters: Adapters, prompt: list[int]
) -> None:
    """Requests on the base, on a served adapter and on one that is loaded and unloaded
    over and over, all at once: every request on the base and the served adapter
    completes with its reference's tokens; one on the churned adapter either runs it
    (its reference's tokens) or is a 404, never the base model or a failure; the churn's
    unloads are 200 or 409 (in use), nothing else."""
    import openai

    names = [None, "sql", "side", None, "sql", "side"] * 4
    done = threading.Event()
    statuses: list[tuple[str, int]] = []

    def churn() -> None:
        while not done.is_set():
            statuses.append(("load", load(server, "side", adapters.paths["poet"]).status_code))
            while True:  # an unload refused because requests run with it: try again
                status = unload(server, "side").status_code
                statuses.append(("unload", status))
                if status != 409:
                    break

    def run(name: str | None) -> Any:
        try:
            return complete(client, name or BASE, prompt)
        except openai.NotFoundError:
            return None

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(run, names))
    finally:
        done.set()
        churner.join(60)
    assert statuses and {s for s in statuses if s[1] != 409} <= {("load", 200), ("unload", 200)}
    for name, answer in zip(names, answers, strict=True):
        if answer is None:
            assert name == "side"
            continue
        reference = "poet" if name == "side" else name
        assert answer.choices[0].finish_reason == "length"
        assert answer.choices[0].text == adapters.text(prompt, adapters.greedy(reference, prompt))
    server.wait_idle()
    assert server.ctx.lora_use.busy() == ()  # every run let go of its adapter


# -- when the routes exist, and start-up -------------------------------------------------------


def test_the_routes_are_404_without_runtime_updating(lora_built: Any) -> None:
    with live_server(lora_built, ServerSettings(served_model_names=(BASE,))) as live:
        body = {"lora_name": "x", "lora_path": "/tmp"}
        assert httpx.post(f"{live.v1}/load_lora_adapter", json=body).status_code == 404
        assert httpx.post(f"{live.v1}/unload_lora_adapter", json=body).status_code == 404


def test_loading_without_enable_lora_is_400(tiny_built: Any) -> None:
    settings = ServerSettings(allow_runtime_lora_updating=True)
    with live_server(tiny_built, settings) as live:
        response = load(live, "x", "/tmp")
        assert response.status_code == 400
        assert "--enable-lora" in error_of(response)["message"]


@pytest.mark.parametrize(
    ("flags", "env", "allowed"),
    [
        ((), None, False),
        (("--allow-runtime-lora-updating",), None, True),
        ((), "True", True),
        ((), "1", True),
        ((), "0", False),
    ],
)
def test_runtime_updating_by_flag_or_vllm_env(
    monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], env: str | None, allowed: bool
) -> None:
    from server.cli import build_parser, settings_from

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    if env is not None:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    args = build_parser().parse_args(["serve", "--enable-lora", *flags])
    assert settings_from(args).allow_runtime_lora_updating is allowed


def test_an_adapter_named_like_the_base_stops_the_start(lora_built: Any) -> None:
    with pytest.raises(ValueError, match="--lora-modules sql"):
        serving_context(lora_built, ServerSettings(served_model_names=("sql",)), with_metrics=False)


def test_metrics_name_the_adapter_slots_of_the_live_server(server: LiveServer) -> None:
    """/metrics of a real --enable-lora server: the gateway gauge carries --max-loras."""
    text = httpx.get(f"{server.url}/metrics").text
    gauge = [line for line in text.splitlines() if line.startswith("kvserve_lora_requests_info{")]
    assert gauge and all('max_lora="2"' in line for line in gauge)
