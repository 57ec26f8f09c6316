"""Step 1: collect K/V per layer exactly as the cache stores them (after RoPE), plus the
post-RoPE queries' second moments, over calibration windows.

Collection wraps the model's attention function (transformers' ``ALL_ATTENTION_FUNCTIONS``
entry for the model's implementation) for the duration of a ``with`` block, so whatever the
architecture does before attention (RoPE, q/k norms) is already applied to what is recorded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import UnsupportedModelError
from .progress import bar

__all__ = ["KVCollection", "LayerSamples", "collect_kv", "record_attention"]


@dataclass
class LayerSamples:
    """What one attention layer saw.

    Attributes:
        k, v: float32 ``(tokens, num_kv_heads, head_dim)`` post-RoPE keys and values.
        q: float32 ``(q_tokens, num_heads, head_dim)`` post-RoPE queries, a strided subsample.
        q_sq: float64 ``(head_dim,)`` mean of ``q_c²`` over all tokens and query heads.
        o_proj: float32 ``(hidden, num_heads * head_dim)`` output projection weight, or None.
    """

    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    q_sq: torch.Tensor
    o_proj: torch.Tensor | None

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])


@dataclass
class KVCollection:
    """Samples of every layer (index = layer) and the number of tokens they cover."""

    layers: list[LayerSamples]
    num_tokens: int
    windows: int = 0
    meta: dict = field(default_factory=dict)


@contextlib.contextmanager
def record_attention(model, callback):
    """Call ``callback(layer_idx, module, query, key, value)`` on every attention call of
    ``model`` (tensors ``(B, heads, T, d)``, post-RoPE, after the cache update) inside the block.

    Raises:
        UnsupportedModelError: the model's attention implementation cannot be wrapped.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(f"attention implementation {impl!r} cannot be recorded; "
                                    "load the model with attn_implementation='sdpa'")
    inner = ALL_ATTENTION_FUNCTIONS[impl]
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping

    def wrapper(module, query, key, value, *args, **kwargs):
        callback(getattr(module, "layer_idx", None), module, query, key, value)
        return inner(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = wrapper
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[impl] = inner
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]


SINK_TOKEN_STRIDE = 64


def window_sink_tokens(windows: torch.Tensor) -> torch.Tensor:
    """The tokens :func:`sink_offsets` averages over for calibration windows int64 ``(n, T)``:
    each window's start and every :data:`SINK_TOKEN_STRIDE`-th token after it — what an
    arbitrary sequence start looks like. int64 ``(n · ceil(T / stride),)``."""
    return windows[:, ::SINK_TOKEN_STRIDE].reshape(-1)


def sink_offsets(model, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_sink, v_sink)``, float32 ``(num_kv_heads, head_dim)`` each: the mean
    post-RoPE key and the mean value at position 0 over one-token forwards of ``tokens``
    (int64 ``(n,)``) — a token at position 0 attends only to itself, so these are the
    attention sink's K/V as a sequence starting with one of ``tokens`` stores them. The
    codec's ``k_sink_offset`` / ``v_sink_offset`` (``benchmarks/results/sink_offset_cpu.md``).

    Raises:
        UnsupportedModelError: no attention call was seen. ValueError: no tokens.
    """
    if tokens.numel() == 0:
        raise ValueError("sink_offsets needs at least one token")
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cb(idx, module, q, k, v):
        acc[idx] = (k[:, :, 0].float().mean(0), v[:, :, 0].float().mean(0))   # (H, d)

    with torch.inference_mode(), record_attention(model, cb):
        model(tokens.reshape(-1, 1), use_cache=False)
    if not acc:
        raise UnsupportedModelError("the model made no attention call tkv could record")
    return [acc[i] for i in sorted(acc)]


def collect_kv(model, windows: torch.Tensor, q_per_window: int = 128,
               show_progress: bool = True) -> KVCollection:
    """Run ``windows`` (int64 ``(n, T)``) through ``model`` and keep every layer's K/V.

    Args:
        q_per_window: queries kept per window and layer (evenly strided), for score errors.

    Returns:
        :class:`KVCollection` with ``n*T`` tokens per layer.

    Raises:
        UnsupportedModelError: no attention call was seen, or K/V are not 4-D.
    """
    store: dict[int, dict[str, list]] = {}

    def cb(idx, module, q, k, v):
        if idx is None or k.dim() != 4:
            raise UnsupportedModelError("attention layer without layer_idx or 4-D K/V")
        s = store.setdefault(idx, {"k": [], "v": [], "q": [], "q_sq": [], "o": None})
        s["k"].append(k[0].transpose(0, 1).float().clone())
        s["v"].append(v[0].transpose(0, 1).float().clone())
        t = q.shape[2]
        step = max(1, t // q_per_window)
        s["q"].append(q[0, :, ::step].transpose(0, 1).float().clone())
        s["q_sq"].append((q[0].double() ** 2).sum(dim=(0, 1)) / (q.shape[1] * t))
        if s["o"] is None and hasattr(module, "o_proj"):
            s["o"] = module.o_proj.weight.detach().float().clone()

    n = windows.shape[0]
    with torch.inference_mode(), record_attention(model, cb):
        pb = bar(n, "collect K/V", show_progress, "win")
        for i in range(n):
            model(windows[i:i + 1], use_cache=False)
            pb.update(1)
        pb.close()
    if not store:
        raise UnsupportedModelError("the model made no attention call tkv could record")
    layers = []
    for idx in sorted(store):
        s = store[idx]
        layers.append(LayerSamples(torch.cat(s["k"]), torch.cat(s["v"]), torch.cat(s["q"]),
                                   torch.stack(s["q_sq"]).mean(0), s["o"]))
    return KVCollection(layers, int(windows.numel()), n)
