"""Forward passes with a given KV cache, and a runner that reuses an uncompressed pass's
per-layer inputs to rerun a window from layer ``l`` only (what quantizing layer ``l`` alone
changes starts there), which halves the cost of per-layer sensitivity measurements.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache

__all__ = ["PrefixRunner", "forward_logits"]


def _cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_logits(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Logits float32 ``(T, vocab)`` of ``ids`` ``(1, T)`` through ``model`` reading/writing
    ``cache`` (a transformers Cache, or None for a plain uncached pass)."""
    kw = {_cache_kw(model): cache, "use_cache": cache is not None}
    with torch.inference_mode():
        return model(ids, **kw).logits[0].float()


class PrefixRunner:
    """One window run uncompressed once; then :meth:`logits_from` reruns layers ``start..``.

    Attributes:
        base_logits: float32 ``(T, vocab)`` uncompressed logits.
        kv: per layer ``(k, v)`` float ``(1, Hkv, T, d)`` uncompressed post-RoPE K/V.
    """

    def __init__(self, model, ids: torch.Tensor):
        self.model = model
        self.ids = ids
        dec = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.layers = getattr(dec, "layers", None)
        self.norm = getattr(dec, "norm", None)
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.resumable = (self.layers is not None and self.norm is not None and self.head is not None
                          and type(model).__name__.endswith("ForCausalLM"))
        self.inputs: list = []
        self.kwargs = None
        hooks = []
        if self.resumable:
            def pre(mod, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                self.inputs.append(h.detach().clone())
                if self.kwargs is None:
                    self.kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            hooks = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in self.layers]
        cache = DynamicCache()
        try:
            self.base_logits = forward_logits(model, ids, cache)
        finally:
            for h in hooks:
                h.remove()
        self.kv = [(layer.keys, layer.values) for layer in cache.layers]
        if self.resumable and len(self.inputs) != len(self.layers):
            self.resumable = False

    def logits_from(self, start: int, cache) -> torch.Tensor:
        """Logits when layers ``>= start`` read ``cache`` (layers before are unchanged, so their
        uncompressed outputs are reused). Falls back to a full pass when not resumable."""
        if not self.resumable or start == 0:
            return forward_logits(self.model, self.ids, cache)
        kw = dict(self.kwargs)
        key = "cache" if "cache" in kw or "past_key_values" not in kw else "past_key_values"
        kw[key] = cache
        kw["use_cache"] = True
        with torch.inference_mode():
            h = self.inputs[start]
            for layer in self.layers[start:]:
                out = layer(h, **kw)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.norm(h))[0].float()
