"""The dense-attention seam of :func:`tkv.kernels.prefill`: the two prefill paths whose
keys are all 16-bit rows — a first chunk (the prefill bypass, ``no_prefix``) and an
exact-prefix continuation over the decompressed prefix (``exact_prefix``) — can hand their
attention to a caller's varlen flash-attention kernel instead of tkv's Triton loop / PyTorch
SDPA. An engine passes its own (tkv-vllm: vLLM's FlashAttention 3 on Hopper), so long
prompts prefill at the engine's bf16 speed; ``tkv.kernels`` itself never imports an engine.

Measured motivation (H200, Qwen3-8B-like, one 32K prompt in vLLM, session 14): tkv's prefill
took 1.74 s against bf16's 1.25 s — the first chunk ran tkv's Triton kernel, the continuation
PyTorch SDPA (FlashAttention-2), where vLLM's bf16 path runs FlashAttention 3. Measured
result (session 15, ``benchmarks/results/vllm_e2e_2026-12-01_s15_qwen_flash/``): with vLLM's
FlashAttention 3 the prefill took 1.28 s (bf16 1.24 s), the request 0.81× → 0.93× bf16; so
tkv-vllm's default is ``auto``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from tkv.codec.errors import DeviceMismatchError, DtypeError, ShapeError, TkvError

from ._util import choice_from_env

__all__ = ["ENV_PREFILL_ATTENTION", "DenseAttention", "FlashDevice", "FlashVarlenAttention",
           "PrefillAttentionConfigError", "SdpaDenseAttention", "TorchVarlenAttention",
           "check_dense_output", "flash_device", "prefill_attention_from_env"]

_log = logging.getLogger(__name__)

ENV_PREFILL_ATTENTION = "TKV_PREFILL_ATTENTION"
_CHOICES = ("auto", "flash", "tkv", "continuation")


class PrefillAttentionConfigError(TkvError, ValueError):
    """``TKV_PREFILL_ATTENTION`` is not ``auto`` / ``tkv`` / ``flash`` / ``continuation``, or
    ``flash`` / ``continuation`` was asked for where the engine's flash-attention kernel cannot
    run (raised by the engine adapters at startup)."""


def prefill_attention_from_env(environ=None, default: str = "tkv") -> str:
    """The engines' prefill-attention choice, ``TKV_PREFILL_ATTENTION``:

    * ``"flash"``: the engine's own varlen FlashAttention through :class:`FlashVarlenAttention`
      (each adapter checks at startup that it can run, and raises if not);
    * ``"tkv"``: tkv's Triton prefill and PyTorch SDPA;
    * ``"auto"``: ``flash`` where it can run, else ``tkv`` (logged, never raised);
    * ``"continuation"``: the engine's FlashAttention for exact-prefix continuation chunks
      only, tkv's Triton bypass kernel for first chunks (an error where flash cannot run).
      An A/B configuration, not yet timed: in vLLM on the H200 the prefill of 512-token
      prompts (first chunks only) took bf16's time through tkv's Triton bypass and 0.5 / 3.5 %
      longer through FlashAttention in the same job (session 15; 5-8 % above bf16 in session
      16), while a 32K prompt's continuation chunks gained most from FlashAttention.

    Unset or blank gives ``default`` (each adapter passes its own; both pass ``auto``: tkv-vllm
    measured on the H200, tkv-sglang since session 32's prefill profile). Case and surrounding
    blanks are ignored.

    Raises:
        PrefillAttentionConfigError: any other value (also for ``default``).
    """
    if str(default).strip().lower() not in _CHOICES:   # the adapter's own constant
        raise PrefillAttentionConfigError(
            f"prefill-attention default {default!r} is not one of {_CHOICES}")
    return choice_from_env(
        environ, ENV_PREFILL_ATTENTION, _CHOICES, default.strip().lower(),
        PrefillAttentionConfigError,
        "use 'auto' (the engine's FlashAttention where it can run, else tkv's kernels), 'flash' "
        "(the engine's FlashAttention for first chunks and exact-prefix continuation chunks; "
        "an error where it cannot run), 'continuation' (FlashAttention for continuation chunks "
        "only, tkv's Triton kernel for first chunks) or 'tkv' (tkv's Triton / SDPA prefill)")


@runtime_checkable
class DenseAttention(Protocol):
    """Varlen causal attention over 16-bit rows, the contract of FlashAttention's
    ``flash_attn_varlen_func`` (Dao et al., FlashAttention-2, 2023; causal mask aligned to the
    bottom-right corner when a sequence has more keys than queries).

    Called as ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
    window)`` with

    * ``q``: ``(total_q, num_q_heads, head_dim)`` float16/bfloat16 (float32 on the exact-prefix
      path under ``TRITON_INTERPRET=1``, where tkv's rotated rows are float32); ``k``, ``v``:
      ``(total_k, num_kv_heads, head_dim)``, same dtype (GQA: ``num_q_heads`` a multiple of
      ``num_kv_heads``, query head ``h`` reads KV head ``h // (num_q_heads / num_kv_heads)``);
      unit stride on head_dim. ``head_dim`` may be a padded width (tkv's rotated rows: 64,
      128 or 256).
    * ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 ``(num_seqs + 1,)`` on q's device,
      cumulative token counts starting at 0; ``max_seqlen_q`` / ``max_seqlen_k``: host ints
      ≥ every sequence's count.
    * ``scale``: softmax scale (float); ``window``: 0 = full causal attention, else query
      ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees keys ``j`` with
      ``0 ≤ (i + Lk − Lq) − j < window`` (FlashAttention's ``window_size=(window − 1, 0)``).

    Returns the output ``(total_q, num_q_heads, head_dim)`` in q's dtype. Must not read a
    device value on the host if the caller captures it in a CUDA graph (prefill runs
    eagerly in both engines).

    Optional attribute ``first_chunks`` (absent = True): False keeps first chunks (the prefill
    bypass) on tkv's Triton kernel and hands only exact-prefix continuations to the callable.
    Optional attribute ``writes_out`` (absent = False): True means the callable also takes a
    keyword ``out`` — a preallocated ``(total_q, num_q_heads, head_dim)`` tensor in q's dtype,
    unit stride on head_dim — writes the result there and returns it (FlashAttention's
    ``out=``); :func:`~tkv.kernels.prefill` then passes its own output for first chunks
    instead of copying the returned rows (a pass over the chunk's output less).
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, scale: float, window: int) -> torch.Tensor: ...


class SdpaDenseAttention:
    """A plain-PyTorch :class:`DenseAttention`: one ``scaled_dot_product_attention`` call per
    sequence with an explicit bottom-right causal (and window) mask. The reference for tests
    and the documentation's example; it reads ``cu_seqlens`` on the host (a device sync per
    call), so it is not what an engine should pass."""

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 scale, window):
        out = torch.empty_like(q)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(cq) - 1):
            qa, qb, ka, kb = cq[i], cq[i + 1], ck[i], ck[i + 1]
            lq, lk = qb - qa, kb - ka
            if lq == 0:
                continue
            rel = (torch.arange(lq, device=q.device)[:, None] + (lk - lq)
                   - torch.arange(lk, device=q.device)[None, :])
            vis = rel >= 0
            if window:
                vis &= rel < window
            o = torch.nn.functional.scaled_dot_product_attention(
                q[qa:qb].transpose(0, 1).float(), k[ka:kb].transpose(0, 1).float(),
                v[ka:kb].transpose(0, 1).float(), attn_mask=vis, scale=scale, enable_gqa=True)
            # a row without a visible key is 0 (FlashAttention's convention); NaN inputs stay NaN
            o = torch.where(vis.any(1)[None, :, None], o, 0.0)
            out[qa:qb] = o.transpose(0, 1).to(q.dtype)
        return out


class FlashDevice(NamedTuple):
    """What :func:`flash_device` found: the CUDA ``device``, what the engine's
    ``import_flash()`` returned (``imported``), and ``first_chunks`` — False for
    ``TKV_PREFILL_ATTENTION=continuation`` (pass it to :class:`FlashVarlenAttention`)."""

    device: torch.device
    imported: Any
    first_chunks: bool


def flash_device(device: torch.device | str, environ, import_flash: Callable[[], Any],
                 unsupported: Callable[[torch.device, Any], str | None] | None = None,
                 default: str = "tkv") -> FlashDevice | None:
    """The engine adapters' common handling of ``TKV_PREFILL_ATTENTION``
    (:func:`prefill_attention_from_env`): None where tkv's own prefill runs, else a
    :class:`FlashDevice` (the CUDA device, what ``import_flash()`` returns — the engine's
    flash-attention entry points — and whether first chunks go to it too).

    Args:
        device: the attention layer's device.
        environ: a mapping, or None for ``os.environ``.
        import_flash: imports the engine's kernels; ImportError means "not available".
        unsupported: ``(device, imported) -> reason or None``: the engine's own checks
            (FlashAttention version for the head size, GPU generation, model dtype).
        default: the adapter's default when the variable is unset.

    With ``auto``, a reason not to use flash (no CUDA device; ``import_flash`` or
    ``unsupported`` raising anything — an ImportError, a broken extension's OSError, a
    RuntimeError from a device query; ``unsupported`` returning a reason) gives None and an
    INFO log line naming it; with ``flash`` or ``continuation`` it raises
    PrefillAttentionConfigError chained to the cause.

    Raises:
        PrefillAttentionConfigError: an unknown value; ``flash`` / ``continuation`` where it
            cannot run (the message keeps the reason, e.g. the import error).
        DeviceMismatchError: ``device`` is not a device (``torch.device`` refuses it), also
            with ``tkv`` (a caller bug either way).
    """
    choice = prefill_attention_from_env(environ, default)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:   # "cuda:x", 3.5, None: torch's own message kept
        raise DeviceMismatchError(f"flash_device: not a device: {device!r} ({e})") from e
    if choice == "tkv":
        return None

    def cannot(reason: str, cause: BaseException | None = None):
        if choice == "auto":
            _log.info("%s=auto: tkv's prefill kernels (%s)", ENV_PREFILL_ATTENTION, reason)
            return None
        raise PrefillAttentionConfigError(f"{ENV_PREFILL_ATTENTION}={choice}: {reason}") from cause

    if dev.type != "cuda":
        return cannot(f"needs a CUDA device (attention on {dev})")
    try:
        imported = import_flash()
    except Exception as e:   # ImportError, or a broken extension (OSError, RuntimeError, ...)
        return cannot(f"the engine's flash attention is not importable "
                      f"({type(e).__name__}: {e})", e)
    try:
        reason = None if unsupported is None else unsupported(dev, imported)
    except Exception as e:   # the engine's own check failed (device query, signature, ...)
        return cannot(f"checking the engine's flash attention failed ({type(e).__name__}: {e})",
                      e)
    if reason is not None:
        return cannot(reason or "the engine reports it unsupported here")
    return FlashDevice(dev, imported, choice != "continuation")


class FlashVarlenAttention:
    """A :class:`DenseAttention` over a FlashAttention-style ``flash_attn_varlen_func`` — the
    keyword names ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``,
    ``softmax_scale``, ``causal``, ``window_size`` shared by vLLM's ``vllm_flash_attn``,
    sgl-kernel's ``flash_attn`` and the flash-attn package.

    Args:
        varlen: the function.
        first_chunks: also run first chunks (the prefill bypass); False: only exact-prefix
            continuation chunks (``TKV_PREFILL_ATTENTION=continuation``).
        **extra: keywords passed on every call (e.g. ``fa_version=3`` for vLLM's,
            ``ver=3`` for sgl-kernel's).

    tkv's window (keys with ``q_pos − k_pos < window``) is FlashAttention's
    ``window_size=(window − 1, 0)``; no window is ``(-1, -1)``.

    ``writes_out`` (see :class:`DenseAttention`): True when ``varlen`` has an ``out``
    parameter — vLLM 0.20.1's ``vllm_flash_attn`` and sgl-kernel 0.4.2's do, the flash-attn
    2.x package's and older sgl-kernels do not — read from its signature unless given; an
    ``out=`` tensor is then passed through.
    """

    def __init__(self, varlen: Any, *, first_chunks: bool = True, writes_out: bool | None = None,
                 **extra: Any):
        if not isinstance(first_chunks, bool):
            raise ValueError(f"first_chunks must be a bool, got {first_chunks!r}")
        if writes_out is None:
            try:
                writes_out = "out" in inspect.signature(varlen).parameters
            except (TypeError, ValueError):   # no signature (some extension functions)
                writes_out = False
        if not isinstance(writes_out, bool):
            raise ValueError(f"writes_out must be a bool or None, got {writes_out!r}")
        self._varlen = varlen
        self.first_chunks = first_chunks
        self.writes_out = writes_out
        self.extra = extra

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 scale, window, out=None):
        extra = self.extra if out is None else {**self.extra, "out": out}
        return self._varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                            softmax_scale=float(scale), causal=True,
                            window_size=(int(window) - 1, 0) if window else (-1, -1),
                            **extra)

    def __repr__(self) -> str:
        name = getattr(self._varlen, "__module__", "?") + "." + getattr(
            self._varlen, "__name__", "?")
        kw = ", ".join(f"{k}={v!r}" for k, v in (
            self.extra if self.first_chunks else {"first_chunks": False, **self.extra}).items())
        return f"FlashVarlenAttention({name}{', ' + kw if kw else ''})"


class TorchVarlenAttention:
    """A :class:`DenseAttention` over PyTorch's own varlen FlashAttention,
    ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside PyTorch ≥ 2.11; CUDA,
    float16 / bfloat16 rows, GQA by head counts) — for callers without an engine kernel, e.g.
    ``tkv-codec`` + ``tkv-kernels`` inside a FlashInfer stack, and for benchmarks on a bare
    GPU. No host sync (the cu_seqlens stay on the device).

    Args:
        first_chunks: also run first chunks (the prefill bypass); False: only the paths over
            a decompressed prefix.

    tkv's window (keys with ``q_pos − k_pos < window``) is ``window_size=(window − 1, 0)``;
    no window is ``(-1, 0)`` (causal, bottom-right aligned when a sequence has more keys
    than queries). ``writes_out`` is False: ``varlen_attn`` has no ``out=``.

    Raises:
        ImportError: this PyTorch has no ``torch.nn.attention.varlen`` (before 2.10), or its
            ``varlen_attn`` takes no ``window_size`` (2.10 has ``is_causal`` only).
    """

    writes_out = False

    def __init__(self, *, first_chunks: bool = True):
        if not isinstance(first_chunks, bool):
            raise ValueError(f"first_chunks must be a bool, got {first_chunks!r}")
        from torch.nn.attention.varlen import varlen_attn

        if "window_size" not in inspect.signature(varlen_attn).parameters:
            raise ImportError(f"TorchVarlenAttention needs torch.nn.attention.varlen."
                              f"varlen_attn with window_size (PyTorch ≥ 2.11); torch "
                              f"{torch.__version__} has {inspect.signature(varlen_attn)}")
        self._varlen = varlen_attn
        self.first_chunks = first_chunks

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 scale, window):
        return self._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                            int(max_seqlen_k), scale=float(scale),
                            window_size=(int(window) - 1, 0) if window else (-1, 0))

    def __repr__(self) -> str:
        return f"TorchVarlenAttention(first_chunks={self.first_chunks})"


def check_dense_output(o, q: torch.Tensor) -> torch.Tensor:
    """``o`` if a :class:`DenseAttention` returned a tensor of q's shape, dtype and device;
    else :class:`ShapeError` / :class:`DtypeError` naming what came back (a callback bug must
    not surface as garbage rows)."""
    if not isinstance(o, torch.Tensor):
        raise DtypeError(f"dense_attention returned {type(o).__name__}, not a tensor")
    if tuple(o.shape) != tuple(q.shape) or o.device != q.device:
        raise ShapeError(f"dense_attention returned {tuple(o.shape)} on {o.device}; expected "
                         f"{tuple(q.shape)} on {q.device}")
    if o.dtype != q.dtype:
        raise DtypeError(f"dense_attention returned {o.dtype}; expected {q.dtype}")
    return o
