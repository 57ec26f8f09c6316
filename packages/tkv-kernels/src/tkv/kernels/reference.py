"""Plain-PyTorch float64 oracle for the kernels: gather each sequence's K/V from the paged
cache, dequantize with the codec's own functions, run textbook softmax attention.

Slow and simple on purpose; tests and benchmarks compare the Triton kernels against it.
"""

from __future__ import annotations

import math

import torch

from tkv.codec.packing import unpack_codes

from .loaders import BypassLoader, Fp8Loader, TkvLoader

__all__ = ["attention_reference", "decode_reference", "gather_kv", "prefill_reference"]


def _tkv_gather(cache, loader: TkvLoader, blocks, offs):
    lay, codec = loader.layout, loader.codec
    v = lay.views(cache)
    out = []
    for side, sc in (("k", codec.k), ("v", codec.v)):
        codes = v[f"{side}_codes"][blocks, :, offs]           # (n, H, code_bytes)
        norms = v[f"{side}_norms"][blocks, :, offs].double()  # (n, H)
        idx = unpack_codes(codes, sc.bits, lay.head_dim)
        y = sc.centroids.double().to(codes.device)[idx] / math.sqrt(lay.head_dim)
        y = y * norms.abs().unsqueeze(-1)
        x = codec.rotation.inverse(y)
        if sc.channel_scales is not None:
            x = x * sc.channel_scales.double()
        # back to model space: + μ (key centering; μ (d,) shared by the heads, or (H, d): row h
        # added to head h — x is (n, H, d), so both broadcast), or + σ, the sink offset, for
        # vectors whose norm has its sign BIT set (a flagged zero norm is −0.0)
        base = 0.0 if sc.channel_offset is None else sc.channel_offset.double().to(x.device)
        if sc.sink_offset is not None:
            flag = torch.signbit(norms).unsqueeze(-1)
            x = x + torch.where(flag, sc.sink_offset.double().to(x.device), base)
        else:
            x = x + base
        out.append(x)
    return out


def gather_kv(cache, loader, block_table_row: torch.Tensor, length: int):
    """K, V float64 ``(length, num_kv_heads, head_dim)`` in model space for one sequence."""
    pos = torch.arange(length, device=block_table_row.device)
    blocks = block_table_row.long()[pos // loader.block_size]
    offs = pos % loader.block_size
    if isinstance(loader, TkvLoader):
        return _tkv_gather(cache, loader, blocks, offs)
    if isinstance(loader, BypassLoader):
        return [c[blocks, offs].double() for c in cache]
    if isinstance(loader, Fp8Loader):
        return [c.view(torch.float8_e4m3fn)[blocks, offs].double() * s.double()
                for c, s in zip(cache, (loader.k_scale, loader.v_scale), strict=True)]
    raise TypeError(f"no reference for loader {type(loader).__name__}")


def attention_reference(q, k, v, q_pos, k_pos, sm_scale=None, window: int = 0):
    """float64 attention. q ``(m, Hq, D)``, k/v ``(n, Hkv, D)``, absolute positions q_pos
    ``(m,)`` and k_pos ``(n,)``; key j visible to query i iff ``k_pos ≤ q_pos`` and (window)
    ``q_pos − k_pos < window``. Returns ``(m, Hq, D)`` float64."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kk) * scale
    vis = k_pos[None, :] <= q_pos[:, None]
    if window:
        vis = vis & (q_pos[:, None] - k_pos[None, :] < window)
    s = s.masked_fill(~vis[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hmn,nhd->mhd", p, vv)


def decode_reference(query, cache, block_table, seq_lens, loader, sm_scale=None, window=0):
    """float64 ``(num_seqs, Hq, D)`` decode output (seq_len 0 → zeros)."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = gather_kv(cache, loader, block_table[i], n)
        pos = torch.arange(n, device=query.device)
        out[i] = attention_reference(query[i: i + 1], k, v, pos[-1:], pos, sm_scale, window)[0]
    return out


def prefill_reference(query, key, value, cu_seqlens_q, seq_lens, cache, block_table, loader,
                      sm_scale=None, window=0):
    """float64 ``(total_q, Hq, D)``: per sequence the prefix ``seq_len − q_len`` tokens come
    from the cache (dequantized), the chunk from ``key``/``value`` as given."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    cu = cu_seqlens_q.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        a, b = cu[i], cu[i + 1]
        ql = b - a
        if ql == 0:
            continue
        pre = n - ql
        ks, vs = [key[a:b].double()], [value[a:b].double()]
        if pre > 0:
            kp, vp = gather_kv(cache, loader, block_table[i], pre)
            ks.insert(0, kp)
            vs.insert(0, vp)
        k, v = torch.cat(ks), torch.cat(vs)
        kpos = torch.arange(n, device=query.device)
        out[a:b] = attention_reference(query[a:b], k, v, kpos[pre:], kpos, sm_scale, window)
    return out
