"""Helpers to build random paged-cache scenarios (for tests, benchmarks and engine adapters'
tests): random non-contiguous block tables, slot mappings, poisoned caches; a check of the
engine plugins' JIT log hook; and the CUDA decode kernel's timeline probe."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from tkv.codec import TurboKVCodec

from .loaders import BypassLoader, Fp8Loader, TkvLoader
from .store import compress_store

__all__ = [
    "PROBE_WORDS",
    "PagedBatch",
    "capture_cuda_decode_launch",
    "check_register_installs_jit_log",
    "fill_cache",
    "jit_hooks_isolated",
    "make_cache",
    "make_paged_batch",
    "no_stream_sync",
    "offset_codec",
    "probe_cuda_decode",
    "reference_flash_varlen",
    "relative_error",
    "tolerance",
    "tuning",
]


class PagedBatch:
    """A batch of sequences placed in random, non-contiguous physical blocks.

    Attributes:
        seq_lens: int32 ``(num_seqs,)``; block_table: int32 ``(num_seqs, max_blocks)``
        (unused entries poisoned with out-of-range ids); num_blocks: physical blocks.
    """

    def __init__(self, seq_lens, block_table, num_blocks, block_size):
        self.seq_lens, self.block_table = seq_lens, block_table
        self.num_blocks, self.block_size = num_blocks, block_size

    def slots(self, i: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """int64 slot ids of sequence ``i``'s tokens ``start..end-1``."""
        n = int(self.seq_lens[i]) if end is None else end
        pos = torch.arange(start, n, device=self.block_table.device)
        return (self.block_table[i].long()[pos // self.block_size] * self.block_size
                + pos % self.block_size)


def make_paged_batch(lens, block_size: int, device, extra_blocks: int = 3,
                     generator: torch.Generator | None = None) -> PagedBatch:
    """Random permutation of physical blocks over the sequences of lengths ``lens``."""
    need = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    maxb = max(max(need), 1) + 1
    bt = torch.full((len(lens), maxb), 10**6, dtype=torch.int32)  # poison: never read
    k = 0
    for i, nb in enumerate(need):
        bt[i, :nb] = perm[k: k + nb].int()
        k += nb
    return PagedBatch(torch.tensor([int(n) for n in lens], dtype=torch.int32, device=device),
                      bt.to(device), num_blocks, block_size)


def make_cache(loader, num_blocks: int, device, generator: torch.Generator | None = None):
    """A poisoned cache of ``num_blocks`` blocks in the loader's format: random bytes (tkv;
    may decode to NaN norms), NaN (bypass) or NaN encodings (fp8) — never zeros."""
    if isinstance(loader, TkvLoader):
        return torch.randint(0, 256, (num_blocks, loader.layout.page_bytes), dtype=torch.uint8,
                             generator=generator).to(device)
    shape = (num_blocks, loader.block_size, loader.num_kv_heads, loader.head_dim)
    if isinstance(loader, BypassLoader):
        return tuple(torch.full(shape, float("nan"), dtype=loader.dtype, device=device)
                     for _ in range(2))
    if isinstance(loader, Fp8Loader):
        return tuple(torch.full(shape, 0x7F, dtype=torch.uint8, device=device)
                     .view(torch.float8_e4m3fn) for _ in range(2))
    raise TypeError(f"unknown loader {type(loader).__name__}")


def fill_cache(loader, cache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor):
    """Write ``key``/``value`` ``(n, num_kv_heads, head_dim)`` into ``slots`` (int64 ``(n,)``):
    :func:`compress_store` for tkv, plain indexing for bypass / fp8 (value / scale)."""
    if isinstance(loader, TkvLoader):
        compress_store(key, value, cache, slots, loader)
        return
    b, o = slots // loader.block_size, slots % loader.block_size
    if isinstance(loader, BypassLoader):
        cache[0][b, o] = key.to(loader.dtype)
        cache[1][b, o] = value.to(loader.dtype)
    else:
        cache[0][b, o] = (key.float() / loader.k_scale).to(torch.float8_e4m3fn)
        cache[1][b, o] = (value.float() / loader.v_scale).to(torch.float8_e4m3fn)


def offset_codec(head_dim: int, k_bits: int, v_bits: int, num_kv_heads: int,
                 generator: torch.Generator, *, center: bool = False, scales: bool = False,
                 sink: bool = False, device="cuda", seed: int = 0) -> TurboKVCodec:
    """A :class:`~tkv.codec.TurboKVCodec` with random per-head calibration terms drawn from
    ``generator`` (CPU), in this order: key centering ``k_channel_offset`` (``center``), K and V
    channel scales in [0.5, 1.5) (``scales``), K and V sink offsets of scale 4 (``sink``; all
    ``(num_kv_heads, head_dim)`` float32). ``seed``: the codec's rotation seed."""
    kw = {}
    if center:
        kw["k_channel_offset"] = torch.randn(num_kv_heads, head_dim, generator=generator)
    if scales:
        kw["k_channel_scales"] = torch.rand(head_dim, generator=generator) + 0.5
        kw["v_channel_scales"] = torch.rand(head_dim, generator=generator) + 0.5
    if sink:
        kw.update(k_sink_offset=torch.randn(num_kv_heads, head_dim, generator=generator) * 4,
                  v_sink_offset=torch.randn(num_kv_heads, head_dim, generator=generator) * 4)
    return TurboKVCodec(head_dim, k_bits=k_bits, v_bits=v_bits, device=device, seed=seed, **kw)


@contextlib.contextmanager
def tuning(module, **kw):
    """Run with ``module.TUNING`` (a CUDA kernel module's launch defaults, e.g.
    :data:`tkv.kernels.cuda_decode.TUNING`) updated by ``kw``; restored on exit."""
    old = dict(module.TUNING)
    module.TUNING.update(kw)
    try:
        yield
    finally:
        module.TUNING.clear()
        module.TUNING.update(old)


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error bound of a kernel output vs the float64 oracle: 1e-4 under the Triton
    interpreter (float32 dots), else the dot dtype's rounding (fp16 6e-3, bf16 2.5e-2)."""
    from ._util import interpreting

    if interpreting():
        return 1e-4
    return 6e-3 if dtype == torch.float16 else 2.5e-2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; raises AssertionError if ``out`` has a non-finite
    entry (an unwritten or poisoned output)."""
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_flash_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, out=None, **version):
    """A CPU stand-in for an engine's ``flash_attn_varlen_func`` behind
    :class:`~tkv.kernels.FlashVarlenAttention` (tests of the engines' flash prefill paths):
    FlashAttention's ``window_size`` decoded back to tkv's window, then
    :class:`~tkv.kernels.SdpaDenseAttention`; with ``out`` (q's shape and dtype) the result is
    written there and ``out`` returned, as FlashAttention does. ``version`` keywords
    (``fa_version``, ``ver``) are accepted and ignored; callers check them.

    Raises:
        AssertionError: ``causal`` is not True (tkv's prefill paths are causal), or ``out``
            does not have q's shape and dtype.
    """
    from .dense_attention import SdpaDenseAttention

    assert causal is True, causal
    window = 0 if tuple(window_size) == (-1, -1) else window_size[0] + 1
    o = SdpaDenseAttention()(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, window)
    if out is None:
        return o
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    return out.copy_(o)


@contextlib.contextmanager
def no_stream_sync():
    """Run a block with torch's CUDA sync debug mode at ``"error"``: any synchronizing CUDA
    call inside it (``.item()``, a device-to-host copy, ``torch.cuda.synchronize``) raises
    ``RuntimeError``. The mode is restored to ``"default"`` even when the block or the switch
    itself fails. torch warns that the mode is a prototype on every switch; the warning is
    silenced here, because under ``filterwarnings = error`` it would be raised *after* the mode
    was set and leave every later test in the process failing on its first sync."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def jit_hooks_isolated():
    """Run a block with :mod:`tkv.kernels.jit_log` uninstalled and restore Triton's
    compilation listener and the module's install state afterwards (tests install the log,
    then leave no trace)."""
    from triton import knobs

    from . import jit_log

    saved, state = knobs.compilation.listener, dict(jit_log._INSTALLED)
    knobs.compilation.listener = None
    jit_log._INSTALLED.clear()
    try:
        yield
    finally:
        knobs.compilation.listener = saved
        jit_log._INSTALLED.clear()
        jit_log._INSTALLED.update(state)


def check_register_installs_jit_log(register, path, monkeypatch) -> None:
    """Engine-plugin test helper: with ``TKV_JIT_LOG=path`` (set through pytest's
    ``monkeypatch``), ``register()`` installs :mod:`tkv.kernels.jit_log` at ``path``. Triton's
    compilation listener and the module's state are restored afterwards
    (:func:`jit_hooks_isolated`).

    Raises:
        AssertionError: the log was not installed there.
    """
    from . import jit_log

    with jit_hooks_isolated():
        monkeypatch.setenv(jit_log.ENV, str(path))
        register()
        assert jit_log._INSTALLED.get("path") == str(path), jit_log._INSTALLED
        assert Path(path).is_file()


PROBE_WORDS = 8   # u64 words per CTA of the CUDA decode kernel's timeline probe (PROBE_WORDS)


def capture_cuda_decode_launch(fn) -> dict:
    """Run ``fn`` (e.g. a ``decode`` call) with the CUDA decode kernel's launcher watched:
    ``{"defs", "grid", "args"}`` of its last split-kernel launch (empty if none), for
    :func:`probe_cuda_decode`."""
    from . import cuda_decode
    seen: dict = {}
    orig = cuda_decode._launch

    def spy(defs, grid, *args):
        seen.update(defs=defs, grid=grid, args=args)
        return orig(defs, grid, *args)

    cuda_decode._launch = spy
    try:
        fn()
    finally:
        cuda_decode._launch = orig
    return seen


def probe_cuda_decode(launch: dict) -> torch.Tensor:
    """Relaunch a captured split-schedule launch (:func:`capture_cuda_decode_launch`) built
    with the kernel's timeline probe (``PROBE=1``, see ``cuda/decode_k4v4.cu``): it computes
    and writes exactly what the captured launch does, and returns int64 ``(ctas,
    PROBE_WORDS)`` on the CPU, row = the CTA's linear index ``x + X·(y + Y·z)``: words 0-6 the
    ``%globaltimer`` (ns) at entry, after the prologue, after the first and the ninth ring
    wait, after warp 0's loop, once every warp is done, at exit (0 where the CTA did not get
    there: no steps, fewer than 9 iterations, a team's idle CTA); word 7 the SM id (low 32
    bits) and warp 0's 16-token steps (high 32). Synchronizes the device.

    Raises:
        ShapeError: nothing was captured (the call ran no CUDA split kernel, e.g. the Triton
            fallback) or the launch is the balanced schedule's (no probe there)."""
    from tkv.codec.errors import ShapeError

    from . import cuda_decode
    if not launch:
        raise ShapeError("no CUDA decode launch was captured (the call ran another kernel)")
    defs, grid, args = launch["defs"], launch["grid"], list(launch["args"])
    if defs["BALANCED"]:
        raise ShapeError("the timeline probe is the split schedule's")
    ctas = grid[0] * grid[1] * grid[2]
    head = (grid[0] * grid[1] + 1) // 2   # the in-kernel merge's int32 counters, as u64 words
    buf = torch.zeros(head + ctas * PROBE_WORDS, dtype=torch.int64, device=args[0].device)
    args[-3] = buf   # the counters argument: the merge's counters, then the probe's rows
    cuda_decode._launch({**defs, "PROBE": 1}, grid, *args)
    torch.cuda.synchronize(buf.device)
    return buf[head:].view(ctas, PROBE_WORDS).cpu()
