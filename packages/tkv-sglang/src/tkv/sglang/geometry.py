"""The served model's attention geometry, read from SGLang's ``ModelConfig``, and the
refusal of model kinds the tkv KV cache cannot serve.

Kept free of sglang imports (duck-typed on ``ModelConfig``'s attributes) so it is unit-tested
without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from tkv.kernels import head_dim_refusal

from .errors import UnsupportedFeatureError

__all__ = ["AttentionGeometry", "geometry_from_model_config"]


@dataclass(frozen=True)
class AttentionGeometry:
    """Decoder self-attention geometry of a whole model (before tensor parallelism).

    Attributes:
        num_layers: attention layers (= the bundle's ``geometry.num_layers``).
        num_kv_heads: KV heads per layer, whole model.
        head_dim: elements per K/V head vector (K and V equal).
        layer_types: the config's per-layer attention kinds (``"full_attention"`` ...), or
            None when it lists none; sliding_window: its window in tokens, or None. Compared
            with a bundle's by :meth:`tkv.codec.ModelGeometry.check_layer_kinds`.
        model: SGLang's ``model_path`` (a bundle made for another name only warns), or None.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    model: str | None = None


def geometry_from_model_config(model_config) -> AttentionGeometry:
    """Geometry of an SGLang ``ModelConfig`` (``sglang.srt.configs.model_config``).

    Raises:
        UnsupportedFeatureError: MLA attention, hybrid sliding-window models (Gemma 2/3 style
            SWA pools), encoder-decoder or cross-attention models, ``v_head_dim != head_dim``,
            a head_dim the adapters do not serve (:data:`tkv.kernels.SERVED_HEAD_DIMS`).
            (Hybrid linear-attention / Mamba models are refused by the pool factory, which
            sees the ModelRunner.)
    """
    arch = getattr(getattr(model_config, "attention_arch", None), "name", "MHA")
    name = (getattr(getattr(model_config, "hf_config", None), "architectures", None) or ["?"])[0]
    if arch == "MLA":
        raise UnsupportedFeatureError(
            f"{name} uses MLA attention; --kv-cache-dtype tkv serves MHA/GQA decoders only")
    if getattr(model_config, "is_hybrid_swa", False):
        raise UnsupportedFeatureError(
            f"{name} is a hybrid sliding-window model (separate SWA KV pool); not supported "
            "by --kv-cache-dtype tkv yet")
    if getattr(model_config, "is_encoder_decoder", False):
        raise UnsupportedFeatureError(
            f"{name} is an encoder-decoder model; cross attention is not supported by tkv")
    num_hidden = int(model_config.num_hidden_layers)
    num_attn = int(getattr(model_config, "num_attention_layers", num_hidden))
    if num_attn != num_hidden:
        raise UnsupportedFeatureError(
            f"{name} has {num_attn} attention layers for {num_hidden} hidden layers "
            "(cross attention or looped layers); not supported by tkv")
    head_dim = int(model_config.head_dim)
    v_head_dim = int(getattr(model_config, "v_head_dim", head_dim) or head_dim)
    if v_head_dim != head_dim:
        raise UnsupportedFeatureError(
            f"{name} has v_head_dim={v_head_dim} != head_dim={head_dim}; tkv needs equal K/V "
            "head sizes")
    refusal = head_dim_refusal(head_dim)
    if refusal:
        raise UnsupportedFeatureError(f"--kv-cache-dtype tkv: {name} has {refusal}")
    text = getattr(model_config, "hf_text_config", None)
    kinds = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    return AttentionGeometry(
        num_hidden, int(model_config.get_total_num_kv_heads()), head_dim,
        tuple(str(k) for k in kinds) if isinstance(kinds, list | tuple) else None,
        window if isinstance(window, int) and not isinstance(window, bool) else None,
        getattr(model_config, "model_path", None))
