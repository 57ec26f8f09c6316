"""Host-side checks of engine metadata (block tables, lengths, slots) against a cache.

The kernels never read out of bounds (block ids outside ``[0, num_blocks)`` and slots past the
cache are masked), but masked reads silently drop tokens. These checks read the metadata back
to the host (a device sync: debug mode, tests and engine start-up only — not inside a CUDA
graph) and raise a named error instead.
"""

from __future__ import annotations

import torch

from tkv.codec.errors import ShapeError

__all__ = ["MetadataError", "check_metadata"]


class MetadataError(ShapeError):
    """Block table / seq_lens / cu_seqlens / slot_mapping inconsistent with the cache."""


def check_metadata(num_blocks: int, block_size: int, *, block_table: torch.Tensor | None = None,
                   seq_lens: torch.Tensor | None = None,
                   cu_seqlens_q: torch.Tensor | None = None,
                   slot_mapping: torch.Tensor | None = None) -> None:
    """Raise :class:`MetadataError` unless the metadata addresses only existing cache slots.

    Checks: ``0 ≤ seq_lens[i] ≤ max_blocks_per_seq · block_size``; every block id a sequence
    uses (``block_table[i, :ceil(seq_lens[i]/block_size)]``) in ``[0, num_blocks)``;
    ``cu_seqlens_q`` non-decreasing from 0 with ``q_len ≤ seq_len``; slots ``-1`` or in
    ``[0, num_blocks · block_size)``. Syncs with the device.
    """
    if seq_lens is not None and block_table is not None:
        sl = seq_lens.detach().long().cpu()
        bt = block_table.detach().long().cpu()
        cap = bt.shape[1] * block_size
        if (sl < 0).any() or (sl > cap).any():
            i = int(((sl < 0) | (sl > cap)).nonzero()[0])
            raise MetadataError(f"seq_lens[{i}] = {int(sl[i])} outside [0, {cap}] "
                                f"(max_blocks_per_seq={bt.shape[1]}, block_size={block_size})")
        need = (sl + block_size - 1) // block_size
        used = torch.arange(bt.shape[1])[None, :] < need[:, None]
        bad = used & ((bt < 0) | (bt >= num_blocks))
        if bad.any():
            i, j = (int(v) for v in bad.nonzero()[0])
            raise MetadataError(f"block_table[{i}, {j}] = {int(bt[i, j])} is not a block of a "
                                f"cache with {num_blocks} blocks")
        if cu_seqlens_q is not None:
            cu = cu_seqlens_q.detach().long().cpu()
            ql = cu[1:] - cu[:-1]
            if int(cu[0]) != 0 or (ql < 0).any():
                raise MetadataError("cu_seqlens_q must start at 0 and be non-decreasing")
            if (ql > sl).any():
                i = int((ql > sl).nonzero()[0])
                raise MetadataError(f"sequence {i}: q_len {int(ql[i])} > seq_len {int(sl[i])}")
    if slot_mapping is not None:
        s = slot_mapping.detach().long().cpu()
        bad = (s >= num_blocks * block_size) | (s < -1)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise MetadataError(f"slot_mapping[{i}] = {int(s[i])} outside [-1, "
                                f"{num_blocks * block_size})")
