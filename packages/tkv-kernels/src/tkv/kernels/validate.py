"""Host-side checks of engine metadata (block tables, lengths, slots) against a cache, and
which head_dim the engine adapters serve.

The kernels never read out of bounds (block ids outside ``[0, num_blocks)`` and slots past the
cache are masked), but masked reads silently drop tokens. These checks read the metadata back
to the host (a device sync: debug mode, tests and engine start-up only — not inside a CUDA
graph) and raise a named error instead.
"""

from __future__ import annotations

import torch

from tkv.codec.errors import ShapeError

__all__ = ["SERVED_HEAD_DIMS", "MetadataError", "check_metadata", "head_dim_refusal",
           "serves_head_dim"]

# head_dim the engine adapters (tkv-vllm, tkv-sglang) serve: powers of two, so that the
# random Walsh–Hadamard rotation is one Hadamard block that the decode kernel applies to the
# query in registers (fused query rotation) and prefill's tiles need no padded columns. The
# kernels themselves also run padded head_dims (e.g. 96 in 128 columns, tested under the
# interpreter); no engine serves one until it is measured end to end.
SERVED_HEAD_DIMS = (16, 32, 64, 128, 256)


def serves_head_dim(head_dim: int) -> bool:
    """Whether the engine adapters serve ``head_dim`` (:data:`SERVED_HEAD_DIMS`)."""
    return head_dim in SERVED_HEAD_DIMS


def head_dim_refusal(head_dim: int) -> str | None:
    """Why the engine adapters refuse ``head_dim`` (for their startup errors, after the
    model's name), or None when they serve it."""
    if serves_head_dim(head_dim):
        return None
    return (f"head_dim {head_dim}; tkv serves head_dim "
            f"{', '.join(map(str, SERVED_HEAD_DIMS))} (a power of two: the kernels' "
            "Walsh–Hadamard rotation)")


class MetadataError(ShapeError):
    """Block table / seq_lens / cu_seqlens / slot_mapping inconsistent with the cache."""


def _host(x: torch.Tensor | None, name: str, ndim: int) -> torch.Tensor | None:
    """``x`` as a host int64 tensor, after checking it is a tensor of ``ndim`` dims."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise MetadataError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise MetadataError(f"{name} must have {ndim} dim(s), got shape {tuple(x.shape)}")
    return x.detach().long().cpu()


def check_metadata(num_blocks: int, block_size: int, *, block_table: torch.Tensor | None = None,
                   seq_lens: torch.Tensor | None = None,
                   cu_seqlens_q: torch.Tensor | None = None,
                   slot_mapping: torch.Tensor | None = None,
                   total_q: int | None = None) -> None:
    """Raise :class:`MetadataError` unless the metadata addresses only existing cache slots
    and query rows.

    Checks, each with whatever is given: ``block_table`` 2-D, ``seq_lens`` / ``slot_mapping``
    1-D, ``cu_seqlens_q`` 1-D with ``len(seq_lens) + 1`` entries and ``block_table`` with
    ``len(seq_lens)`` rows; ``seq_lens ≥ 0`` and ``≤ max_blocks_per_seq · block_size``; every
    block id a sequence uses (``block_table[i, :ceil(seq_lens[i]/block_size)]``) in
    ``[0, num_blocks)``; ``cu_seqlens_q`` non-decreasing from 0 with ``q_len ≤ seq_len`` and,
    with ``total_q`` (the rows of the query / key / value tensors), ending at ``total_q``;
    slots ``-1`` or in ``[0, num_blocks · block_size)``. Syncs with the device.
    """
    sl = _host(seq_lens, "seq_lens", 1)
    bt = _host(block_table, "block_table", 2)
    cu = _host(cu_seqlens_q, "cu_seqlens_q", 1)
    s = _host(slot_mapping, "slot_mapping", 1)
    if sl is not None and (sl < 0).any():
        i = int((sl < 0).nonzero()[0])
        raise MetadataError(f"seq_lens[{i}] = {int(sl[i])} is negative")
    if sl is not None and bt is not None:
        if bt.shape[0] != sl.shape[0]:
            raise MetadataError(f"block_table has {bt.shape[0]} rows for {sl.shape[0]} seq_lens")
        cap = bt.shape[1] * block_size
        if (sl > cap).any():
            i = int((sl > cap).nonzero()[0])
            raise MetadataError(f"seq_lens[{i}] = {int(sl[i])} outside [0, {cap}] "
                                f"(max_blocks_per_seq={bt.shape[1]}, block_size={block_size})")
        need = (sl + block_size - 1) // block_size
        used = torch.arange(bt.shape[1])[None, :] < need[:, None]
        bad = used & ((bt < 0) | (bt >= num_blocks))
        if bad.any():
            i, j = (int(v) for v in bad.nonzero()[0])
            raise MetadataError(f"block_table[{i}, {j}] = {int(bt[i, j])} is not a block of a "
                                f"cache with {num_blocks} blocks")
    if cu is not None:
        if cu.numel() == 0 or int(cu[0]) != 0 or (cu[1:] < cu[:-1]).any():
            raise MetadataError("cu_seqlens_q must start at 0 and be non-decreasing")
        ql = cu[1:] - cu[:-1]
        if sl is not None:
            if ql.shape[0] != sl.shape[0]:
                raise MetadataError(f"cu_seqlens_q has {cu.shape[0]} entries for "
                                    f"{sl.shape[0]} seq_lens (expected {sl.shape[0] + 1})")
            if (ql > sl).any():
                i = int((ql > sl).nonzero()[0])
                raise MetadataError(f"sequence {i}: q_len {int(ql[i])} > seq_len {int(sl[i])}")
        if total_q is not None and int(cu[-1]) != int(total_q):
            raise MetadataError(f"cu_seqlens_q ends at {int(cu[-1])}, the query has {total_q} "
                                "rows")
    if s is not None:
        bad = (s >= num_blocks * block_size) | (s < -1)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise MetadataError(f"slot_mapping[{i}] = {int(s[i])} outside [-1, "
                                f"{num_blocks * block_size})")
