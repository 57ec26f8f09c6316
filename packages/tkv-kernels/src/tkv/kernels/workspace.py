"""One scratch object shared by every layer: split-K partial outputs and rotated queries."""

from __future__ import annotations

import torch

from tkv.codec.errors import ShapeError, TkvError

from ._util import (
    check_import_settings,
    check_positive_int,
    flag_from_env,
    int_from_env,
    next_pow2,
    read_at_import,
)

__all__ = ["DECODE_MIN_SPLIT_TILES", "DECODE_SINGLE_SPLIT", "ENV_DECODE_MIN_SPLIT_TILES",
           "ENV_DECODE_SINGLE_SPLIT", "MAX_MIN_SPLIT_TILES", "SINGLE_SPLIT_TARGETS",
           "MinSplitTilesConfigError", "SingleSplitConfigError", "Workspace",
           "WorkspaceTooSmallError", "check_min_split_tiles", "decode_min_split_tiles_from_env",
           "decode_single_split_from_env"]

ENV_DECODE_SINGLE_SPLIT = "TKV_DECODE_SINGLE_SPLIT"
# the most CTAs per SM a balanced-schedule launch of the CUDA kernel uses (the workspace's
# partial rows are sized for it; the kernel's configurations hold 2-4)
BALANCED_CTAS_PER_SM = 8
# full grids run one split from num_seqs · num_kv_heads ≥ SINGLE_SPLIT_TARGETS · target_programs
SINGLE_SPLIT_TARGETS = 2


class SingleSplitConfigError(TkvError, ValueError):
    """``TKV_DECODE_SINGLE_SPLIT`` is neither ``0`` nor ``1``."""


def decode_single_split_from_env(environ=None) -> bool:
    """Whether a :class:`Workspace` built without ``single_split_ctas`` gives full grids one
    split (``TKV_DECODE_SINGLE_SPLIT=1``, the default since session 19) or always at least
    ``min_splits`` (``0``). On the H200 (K4V4, Hkv=8) one split on grids of ≥ 2 ×
    target_programs CTAs was 1.06-1.11× the split kernel at 640 cached tokens (a 36-layer model
    step 1.028-1.030× at 256 sequences), 0.99-1.03× at 2,048 and 0.97-0.99× at 8,192
    (sessions 18-19); end to end in vLLM (Qwen3-8B-like, session 19, one job) it raised
    decode at 256 sequences (2,048 CTAs, where it applies) by 2.7 %, decode-only 0.91× → 0.94×
    bf16 (`benchmarks/results/vllm_e2e_2026-12-04_s19_split1/`; at 64 sequences both arms ran
    2 splits). Read once at import into
    :data:`DECODE_SINGLE_SPLIT`; a bad value is raised by the engines' startup validation or
    the first kernel call (:func:`._util.read_at_import`).

    Raises:
        SingleSplitConfigError: any other value.
    """
    return flag_from_env(environ, ENV_DECODE_SINGLE_SPLIT, "1", SingleSplitConfigError,
                         "1 (default: one split, written by the split kernel itself, on grids "
                         f"of ≥ {SINGLE_SPLIT_TARGETS}× the workspace's target_programs CTAs) or "
                         "0 (at least min_splits always)")


DECODE_SINGLE_SPLIT = read_at_import(decode_single_split_from_env)

ENV_DECODE_MIN_SPLIT_TILES = "TKV_DECODE_MIN_SPLIT_TILES"
MAX_MIN_SPLIT_TILES = 4096   # a constexpr of the split kernel: each value compiles anew


class MinSplitTilesConfigError(TkvError, ValueError):
    """``TKV_DECODE_MIN_SPLIT_TILES`` is not an integer in [0, MAX_MIN_SPLIT_TILES]."""


def decode_min_split_tiles_from_env(environ=None) -> int:
    """The default ``Workspace.min_split_tiles`` (decode's length-aware split-K:
    ``decode(min_split_tiles=...)``): ``TKV_DECODE_MIN_SPLIT_TILES``, plain digits in
    [0, 4096]; unset or blank: 0 (off, every split gets ``⌈tiles / splits⌉`` tiles). Read
    once at import into :data:`DECODE_MIN_SPLIT_TILES`. Off by default: on the H200 (session
    19, `benchmarks/results/kernels_gpu_2026-12-04_s19_split_rule.md`) it measured 0.85-0.98×
    the plain partition at uniform lengths, no win (`docs/kernels.md`, "Session 19").

    Raises:
        MinSplitTilesConfigError: any other value.
    """
    return int_from_env(environ, ENV_DECODE_MIN_SPLIT_TILES,
                        lambda n: n <= MAX_MIN_SPLIT_TILES, MinSplitTilesConfigError,
                        "0 (off) or a number of tiles per split-K partition in "
                        f"1..{MAX_MIN_SPLIT_TILES}")


DECODE_MIN_SPLIT_TILES = read_at_import(decode_min_split_tiles_from_env)


def check_min_split_tiles(value) -> int:
    """``value`` if it is an int in [0, MAX_MIN_SPLIT_TILES] (each value compiles its own
    split kernel), else ShapeError — the one check of ``Workspace(min_split_tiles=...)`` and
    ``decode(min_split_tiles=...)``."""
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 0 <= value <= MAX_MIN_SPLIT_TILES:
        raise ShapeError(f"min_split_tiles must be an int in [0, {MAX_MIN_SPLIT_TILES}] (0: off; "
                         f"each value compiles its own kernel), got {value!r}")
    return value


class WorkspaceTooSmallError(ShapeError):
    """A call needs more scratch than the :class:`Workspace` was built for."""


class Workspace:
    """Scratch memory for :func:`tkv.kernels.decode`, allocated once and shared by all layers.

    All buffers are allocated in ``__init__``; every call takes views of them, so a decode
    captured in a CUDA graph always reads and writes the same addresses (graph-safe).

    Args:
        max_num_seqs: the largest decode batch (sequences) any call will use.
        max_num_q_heads: the largest number of query heads of any layer (per TP rank).
        max_head_dim: the largest head_dim of any layer (elements).
        device: CUDA device (or CPU for the Triton interpreter).
        max_splits: the most split-K partitions a sequence is cut into (power of two).
        target_programs: split-K aims for ``num_seqs · num_kv_heads · splits ≥ target_programs``
            CTAs; default ``4 × SM count`` on CUDA (fills the chip with several waves).
        min_splits: the fewest partitions (power of two ≤ max_splits) below
            ``single_split_ctas``. Default 2: on the H200, K4V4 decode (pair lookup) at
            B=128, L=1K, Hkv=8 (1,024 CTAs, already past target_programs) took 0.361 ms with
            1 split and 0.217 ms with 2 (4: 0.222, 8: 0.238; bf16 BypassLoader 0.143 vs 0.148
            — `benchmarks/results/kernels_gpu_2026-11-30_lookups.md`): one tile chain per CTA
            leaves the dependent load → lookup → dot latency exposed.
        single_split_ctas: batches with ``num_seqs · num_kv_heads ≥ single_split_ctas`` run
            one split, whose output the split kernel writes itself (no reduce launch, no
            partials: ``decode(single_split_epilogue=True)``); 0 = never. Default
            ``SINGLE_SPLIT_TARGETS × target_programs`` while :data:`DECODE_SINGLE_SPLIT` is on
            (``TKV_DECODE_SINGLE_SPLIT=1``, the default), else 0. With the prmti lookup the
            2-split advantage above depends on the context length: K4V4, Hkv=8, H200, one
            split against the old rule was 1.06-1.11× at 640 cached tokens (B=192-256),
            0.99-1.03× at 2,048 and 0.97-0.99× at 8,192 (session 18,
            `benchmarks/results/kernels_gpu_2026-12-04_s18_split_rule.md`).
        min_split_tiles: decode's default ``min_split_tiles`` (length-aware split-K: a
            sequence uses only as many of the grid's splits as give each at least this many
            tiles; 0 = off). Default :data:`DECODE_MIN_SPLIT_TILES`
            (``TKV_DECODE_MIN_SPLIT_TILES``, default 0).

    Memory: ``rows · d_pad · 4`` bytes of float32 partial outputs plus ``rows · 4`` of LSEs, with
    ``rows = max over n ≤ max_num_seqs of n · max_num_q_heads · splits(n, 1)`` — bounded because
    the split count shrinks as the batch grows.
    """

    def __init__(self, max_num_seqs: int, max_num_q_heads: int, max_head_dim: int,
                 device: torch.device | str = "cuda", *, max_splits: int = 32,
                 target_programs: int | None = None, min_splits: int = 2,
                 single_split_ctas: int | None = None, min_split_tiles: int | None = None):
        check_import_settings()   # a TKV_DECODE_* value refused at import
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_q_heads", max_num_q_heads),
                        ("max_head_dim", max_head_dim), ("max_splits", max_splits)):
            check_positive_int(v, f"Workspace.{name}")
        if max_splits & (max_splits - 1):
            raise ShapeError(f"max_splits must be a power of two, got {max_splits}")
        if (isinstance(min_splits, bool) or not isinstance(min_splits, int) or min_splits < 1
                or min_splits & (min_splits - 1) or min_splits > max_splits):
            raise ShapeError(f"min_splits must be a power of two in [1, max_splits={max_splits}],"
                             f" got {min_splits!r}")
        self.min_splits = min_splits
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_num_q_heads = max_num_q_heads
        self.max_head_dim = max_head_dim
        self.d_pad = max(16, next_pow2(max_head_dim))
        self.max_splits = max_splits
        if target_programs is None:
            if self.device.type == "cuda":
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                target_programs = 4 * sms
            else:
                target_programs = 8
        self.target_programs = int(target_programs)
        if single_split_ctas is None:
            single_split_ctas = (SINGLE_SPLIT_TARGETS * self.target_programs
                                 if DECODE_SINGLE_SPLIT else 0)
        if (isinstance(single_split_ctas, bool) or not isinstance(single_split_ctas, int)
                or single_split_ctas < 0):
            raise ShapeError(f"single_split_ctas must be an int ≥ 0 (0: never), got "
                             f"{single_split_ctas!r}")
        self.single_split_ctas = single_split_ctas
        self.min_split_tiles = check_min_split_tiles(
            DECODE_MIN_SPLIT_TILES if min_split_tiles is None else min_split_tiles)
        rows = max(n * max_num_q_heads * self.splits_for(n, 1) for n in range(1, max_num_seqs + 1))
        self.balanced_ctas = 0   # the most CTAs a balanced-schedule launch may use (CUDA kernel)
        if self.device.type == "cuda":
            self.balanced_ctas = BALANCED_CTAS_PER_SM * torch.cuda.get_device_properties(
                self.device).multi_processor_count
            rows = max(rows, self.balanced_ctas * 2 * min(8, max_num_q_heads))
        self.rows = rows
        self._part_o = torch.empty(rows * self.d_pad, dtype=torch.float32, device=self.device)
        self._part_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        # the balanced schedule's per-(sequence, KV head) part counters: zero between launches
        # (the merging CTA resets its pair's)
        self._counters = torch.zeros(max_num_seqs * max_num_q_heads, dtype=torch.int32,
                                     device=self.device)
        self._q_rot = torch.empty(max_num_seqs * max_num_q_heads * self.d_pad,
                                  dtype=torch.float32, device=self.device)

    def splits_for(self, num_seqs: int, num_kv_heads: int) -> int:
        """Split-K count for a batch: 1 when ``num_seqs · num_kv_heads`` reaches
        ``single_split_ctas`` (non-zero), else a power of two in ``[min_splits, max_splits]``
        aiming at ``target_programs`` CTAs; depends only on the batch shape (never on
        sequence lengths), so it is static under CUDA graphs."""
        ctas = num_seqs * num_kv_heads
        if self.single_split_ctas and ctas >= self.single_split_ctas:
            return 1
        want = -(-self.target_programs // max(1, ctas))
        return max(self.min_splits, min(self.max_splits, next_pow2(want)))

    def cuda_splits_for(self, num_seqs: int, num_kv_heads: int, ctas_per_sm: int = 4) -> int:
        """Split-K count of the CUDA split kernel (``decode(kernel="cuda")``) for a
        configuration holding ``ctas_per_sm`` CTAs per SM: the largest power of two ≤
        ``max_splits`` whose grid ``num_seqs · num_kv_heads · splits`` still fits one wave of
        ``target_programs / 4 · ctas_per_sm`` CTAs (``target_programs / 4`` is the SM count by
        default), one split when even that overflows. Every CTA then starts at once: no
        partial second wave, whose CTAs would run while most SMs idle. Measured on an H100
        (K4V4, Hkv=8): the register lookups (4 CTAs per SM) at 32 sequences 2 splits (512 CTAs)
        0.152 ms against 0.159 with 1; the shared pair tables (3 CTAs per SM) 1 split (256)
        0.134 against 0.164 with 2 (1.29 waves); their 8-warp build (2 per SM) 0.127 with 1
        split, and at 8 sequences 4 splits (256 CTAs) 0.130 ms at L=32K against 0.145 with 2
        (sessions 33, 36). Never more than :meth:`splits_for`, so the partial rows fit; at
        least ``min_splits`` when one split is switched off (``single_split_ctas=0``, e.g.
        ``TKV_DECODE_SINGLE_SPLIT=0``). Static under CUDA graphs (batch shape only)."""
        slots = max(1, self.target_programs * ctas_per_sm // 4)
        pairs = max(1, num_seqs * num_kv_heads)
        fit = 1 << max(0, (slots // pairs).bit_length() - 1) if pairs <= slots else 1
        lo = 1 if self.single_split_ctas else self.min_splits
        return max(lo, min(self.splits_for(num_seqs, num_kv_heads), self.max_splits, fit))

    def partials(self, num_seqs: int, num_q_heads: int, splits: int, d_pad: int):
        """Views ``(o float32 (num_seqs, num_q_heads, splits, d_pad), lse float32 (num_seqs,
        num_q_heads, splits))``. Raises WorkspaceTooSmallError if they do not fit."""
        rows = num_seqs * num_q_heads * splits
        if (num_seqs > self.max_num_seqs or num_q_heads > self.max_num_q_heads
                or d_pad > self.d_pad or rows > self.rows):
            raise WorkspaceTooSmallError(
                f"workspace built for max_num_seqs={self.max_num_seqs}, max_num_q_heads="
                f"{self.max_num_q_heads}, head_dim≤{self.d_pad}, {self.rows} partial rows; call "
                f"needs num_seqs={num_seqs}, q_heads={num_q_heads}, splits={splits}, d_pad={d_pad}")
        o = self._part_o[: rows * d_pad].view(num_seqs, num_q_heads, splits, d_pad)
        lse = self._part_lse[:rows].view(num_seqs, num_q_heads, splits)
        return o, lse

    def balanced_scratch(self, ctas: int, group: int, head_dim: int, pairs: int):
        """Scratch of a balanced-schedule launch of the CUDA kernel
        (:func:`tkv.kernels.cuda_decode.launch_balanced`): ``(o float32 (ctas, 2, group,
        head_dim), lse float32 (ctas, 2, group), counters int32 (pairs,))`` — two part rows per
        CTA and query head (its first and last pair), one counter per (sequence, KV head) pair.

        Raises:
            WorkspaceTooSmallError: they do not fit (more CTAs than :attr:`balanced_ctas`, a
                wider head than ``max_head_dim`` or more pairs than the workspace counts)."""
        rows = ctas * 2 * group
        if (ctas > self.balanced_ctas or rows > self.rows or head_dim > self.d_pad
                or pairs > self._counters.numel()):
            raise WorkspaceTooSmallError(
                f"workspace built for {self.balanced_ctas} balanced CTAs, {self.rows} partial "
                f"rows of ≤{self.d_pad} floats, {self._counters.numel()} pairs; the launch needs "
                f"{ctas} CTAs × 2 × {group} rows of {head_dim} and {pairs} pairs")
        o = self._part_o[: rows * head_dim].view(ctas, 2, group, head_dim)
        lse = self._part_lse[:rows].view(ctas, 2, group)
        return o, lse, self.counters(pairs)

    def counters(self, pairs: int) -> torch.Tensor:
        """int32 ``(pairs,)`` zeros, one per (sequence, KV head) pair, for the CUDA kernel's
        in-kernel merges (the split schedule's ``MERGE_SPLITS``; the balanced schedule's cut
        pairs); every launch leaves them zero. Shared with :meth:`balanced_scratch` (one
        launch at a time on the workspace's stream).

        Raises:
            WorkspaceTooSmallError: more pairs than the workspace counts."""
        if pairs > self._counters.numel():
            raise WorkspaceTooSmallError(f"workspace counts {self._counters.numel()} (sequence, "
                                         f"KV head) pairs; the launch needs {pairs}")
        return self._counters[:pairs]

    def rotated_queries(self, num_seqs: int, num_q_heads: int, head_dim: int) -> torch.Tensor:
        """View ``float32 (num_seqs, num_q_heads, head_dim)`` for rotated queries."""
        n = num_seqs * num_q_heads * head_dim
        if num_seqs > self.max_num_seqs or num_q_heads > self.max_num_q_heads or \
                head_dim > self.max_head_dim:
            raise WorkspaceTooSmallError(
                f"workspace too small for rotated queries ({num_seqs}, {num_q_heads}, {head_dim})")
        return self._q_rot[:n].view(num_seqs, num_q_heads, head_dim)

    def __repr__(self) -> str:
        return (f"Workspace(max_num_seqs={self.max_num_seqs}, max_num_q_heads="
                f"{self.max_num_q_heads}, max_head_dim={self.max_head_dim}, "
                f"max_splits={self.max_splits}, single_split_ctas={self.single_split_ctas}, "
                f"min_split_tiles={self.min_split_tiles}, device={str(self.device)!r})")
