"""Small end-to-end forward of the turbo-attn backend on CPU (Triton interpreter).

Run by test_vllm_forward.py in a subprocess with ``TRITON_INTERPRET=1`` and
``CUDA_VISIBLE_DEVICES=""`` (the interpreter must be on before Triton kernels are defined).
Builds two layers with different (k_bits, v_bits) from a SmartMix-like bundle row (one of
them sliding-window), stores a cached context through ``do_kv_cache_update``, then runs one
mixed batch — a decode (or a spec-decode verify of 1 + 2 tokens), a chunked-prefill
continuation and a first prefill — through the real vLLM metadata builder and ``forward``,
then a CUDA-graph-style padded decode batch, and compares with a float64 reference
(dequantized cached prefix + raw current chunk, causal, GQA, window). Exits non-zero on
mismatch.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import fake_model_config, fake_vllm_config, make_bundle, make_layer


def reference(q, k_new, v_new, kc, vc, ctx, window, scale, decode):
    """float64 attention of one request: q (L, Hq, D); cached kc/vc (seq, Hkv, D) float64."""
    L, hq, d = q.shape
    hkv = kc.shape[1]
    keys = kc if decode else torch.cat([kc[:ctx], k_new.double()])
    vals = vc if decode else torch.cat([vc[:ctx], v_new.double()])
    out = torch.empty(L, hq, d, dtype=torch.float64)
    kpos = torch.arange(keys.shape[0])
    for j in range(L):
        qpos = ctx + j
        vis = kpos <= qpos
        if window:
            vis &= qpos - kpos < window
        for h in range(hq):
            g = h // (hq // hkv)
            s = (keys[vis, g] @ q[j, h].double()) * scale
            p = torch.softmax(s, 0)
            out[j, h] = p @ vals[vis, g]
    return out


def main() -> int:
    worst = max(run(spec_k=0), run(spec_k=2))
    print(f"worst relative error {worst:.2e}")
    return 0 if worst < 2e-2 else 1


def run(spec_k: int) -> float:
    """One mixed batch: request 0 decodes (1 token, or 1 + spec_k for spec-decode verify),
    request 1 continues a chunked prefill, request 2 is a first prefill."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from tkv.codec.bundle import LayerAllocation
    from tkv.kernels import fused_query_rotation_from_env, small_head_groups_from_env
    from tkv.kernels.reference import gather_kv

    load_general_plugins()
    from tkv.vllm import backend as B

    torch.manual_seed(spec_k)
    hd, hq, hkv, bs = 32, 4, 2, 16
    tmp = Path(tempfile.mkdtemp())
    # TKV_FWD_WIDTHS="k0,v0:k1,v1" overrides the two layers' widths (ad-hoc checks of
    # other widths, e.g. "8,8:4,4" as the GPU smoke serves them).
    widths = [tuple(int(b) for b in lw.split(","))
              for lw in os.environ.get("TKV_FWD_WIDTHS", "4,3:3,2").split(":")]
    alloc = LayerAllocation(tuple(w[0] for w in widths), tuple(w[1] for w in widths), "smartmix")
    path = make_bundle(tmp / "b.json", num_layers=2, num_kv_heads=hkv, head_dim=hd,
                       rows={"3.5": alloc})
    os.environ["TKV_BITS"] = "3.5"
    os.environ["TKV_CALIBRATION_FILE"] = str(path)
    vc = fake_vllm_config(fake_model_config(num_layers=2, num_kv_heads=hkv, head_dim=hd),
                          block_size=bs, disable_hybrid=True)
    if spec_k:
        from types import SimpleNamespace

        vc.speculative_config = SimpleNamespace(num_speculative_tokens=spec_k,
                                                parallel_drafting=False)
    B.get_current_vllm_config = lambda: vc

    ctx_lens, q_lens = [20, 13, 0], [1 + spec_k, 7, 9]
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    num_blocks = 12
    perm = torch.randperm(num_blocks).tolist()
    bt = torch.zeros(3, 4, dtype=torch.int32)
    nxt = 0
    for r, s in enumerate(seq_lens):
        for b in range(math.ceil(s / bs)):
            bt[r, b] = perm[nxt]
            nxt += 1

    def slots(r, positions):
        return torch.tensor([int(bt[r, p // bs]) * bs + p % bs for p in positions],
                            dtype=torch.int64)

    worst = 0.0
    for li, window in enumerate([0, 12]):
        name = f"model.layers.{li}.self_attn.attn"
        impl = B.TurboAttnImpl(num_heads=hq, head_size=hd, scale=hd ** -0.5, num_kv_heads=hkv,
                               sliding_window=window or None, kv_cache_dtype="tkv")
        layer = make_layer(name, impl, num_kv_heads=hkv, head_size=hd,
                           sliding_window=window or None, num_heads=hq)
        vc.compilation_config.static_forward_context[name] = layer
        spec = B.TurboAttnBackend.get_kv_cache_spec(layer, vc)
        assert (spec.tkv_k_bits, spec.tkv_v_bits) == (alloc.k_bits[li], alloc.v_bits[li])
        want = os.environ.get("TKV_LOOKUP", "auto")
        assert impl._tkv_state.loader(bs).lookup == want, (impl._tkv_state.lookup, want)
        shg = small_head_groups_from_env()   # unset: on (the default)
        assert impl._tkv_state.loader(bs).small_head_groups == shg
        fqr = fused_query_rotation_from_env()   # unset: on (the default)
        assert impl._tkv_state.loader(bs).fused_query_rotation == fqr
        shape = B.TurboAttnBackend.get_kv_cache_shape_for_spec(num_blocks, bs, spec)
        cache = torch.zeros(shape, dtype=torch.uint8)
        # cached context, stored the way vLLM stores it
        for r, c in enumerate(ctx_lens):
            if c:
                k = torch.randn(c, hkv, hd, dtype=torch.bfloat16)
                v = torch.randn(c, hkv, hd, dtype=torch.bfloat16)
                impl.do_kv_cache_update(layer, k, v, cache, slots(r, range(c)))
        # the mixed step: decode, continuation, first prefill (decodes first)
        n = sum(q_lens)
        q = torch.randn(n, hq, hd, dtype=torch.bfloat16)
        k = torch.randn(n, hkv, hd, dtype=torch.bfloat16)
        v = torch.randn(n, hkv, hd, dtype=torch.bfloat16)
        sm = torch.cat([slots(r, range(c, c + ql))
                        for r, (c, ql) in enumerate(zip(ctx_lens, q_lens, strict=True))])
        impl.do_kv_cache_update(layer, k, v, cache, sm)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        cam = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=3,
            num_actual_tokens=n, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            block_table_tensor=bt, slot_mapping=sm,
            seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32))
        builder = B.TurboAttnMetadataBuilder(spec, [name], vc, torch.device("cpu"))
        md = builder.build(0, cam)
        assert (md.num_decodes, md.decode_query_len, md.num_prefills,
                md.num_prefill_tokens) == (1, 1 + spec_k, 2, 16), md
        # two kernel calls: the continuation row (13 cached tokens, exactly known: one row
        # longer than the decode threshold) and the first chunk (the prefill bypass)
        assert [(r.row_lo, r.row_hi, r.tok_lo, r.tok_hi, r.max_prefix_len, r.no_prefix,
                 r.prefix_exact) for r in md.prefill_runs] == [
            (1, 2, 1 + spec_k, 8 + spec_k, 13, False, True),
            (2, 3, 8 + spec_k, 17 + spec_k, 0, True, False)], md
        assert [c.tolist() for c in md.prefill_cu_seqlens] == [[0, 7], [0, 9]]
        loader = impl._tkv_state.loader(bs)
        # TKV_PREFILL_ATTENTION=tkv, then =flash (faked): the first chunk's run through it
        for flash in (False, True) if not spec_k else (False,):
            with flash_attention(impl, flash) as calls:
                out = torch.full((n, hq, hd), float("nan"), dtype=torch.bfloat16)
                impl.forward(layer, q, k, v, cache, md, output=out)
            assert len(calls) == int(flash), calls
            for r in range(3):
                a, b = int(qsl[r]), int(qsl[r + 1])
                kc, vcache = gather_kv(cache, loader, bt[r], seq_lens[r])
                ref = reference(q[a:b], k[a:b], v[a:b], kc, vcache, ctx_lens[r], window,
                                hd ** -0.5, decode=(r == 0 and not spec_k))
                err = (out[a:b].double() - ref).abs().max().item() / ref.abs().max().item()
                print(f"{'flash ' if flash else ''}spec_k={spec_k} layer {li} "
                      f"K{spec.tkv_k_bits}V{spec.tkv_v_bits} window={window} request {r}: "
                      f"rel err {err:.2e}")
                worst = max(worst, err)
            assert torch.isfinite(out.float()).all()
        if not spec_k:
            worst = max(worst, padded_decode_step(B, impl, layer, cache, bt, seq_lens, slots,
                                                  window, builder, loader, gather_kv,
                                                  CommonAttentionMetadata, li))
            for flash in (False, True):   # TKV_PREFILL_ATTENTION=tkv, then =flash (faked)
                with flash_attention(impl, flash) as calls:
                    worst = max(worst, first_prefill_step(impl, layer, shape, builder, window,
                                                          CommonAttentionMetadata, li))
                    worst = max(worst, long_continuation_step(
                        impl, layer, shape, builder, window, CommonAttentionMetadata,
                        gather_kv, li))
                    worst = max(worst, prefix_hits_step(
                        impl, layer, shape, builder, window, CommonAttentionMetadata,
                        gather_kv, li))
                # flash: the first chunks (one call), the exact-prefix continuation (one call)
                # and the two prefix-cache hits (one varlen call), windows included
                assert len(calls) == (3 if flash else 0), (flash, calls)
                if flash:   # the hits' call: 79 query rows, 48 + 79 packed key rows
                    assert (calls[2][0][0], calls[2][1][0]) == (79, 127), calls
    return worst


@contextlib.contextmanager
def flash_attention(impl, on: bool):
    """With ``on``: the layer's prefill attention is :class:`FlashVarlenAttention` (as
    ``TKV_PREFILL_ATTENTION=flash`` binds it) over a fake ``flash_attn_varlen_func`` that
    checks the FlashAttention keyword contract and computes with the reference
    (``tkv.kernels.testing.reference_flash_varlen``); yields
    the list of its calls. Off: yields an empty list."""
    from tkv.kernels import FlashVarlenAttention
    from tkv.kernels.testing import reference_flash_varlen

    calls: list = []

    def fake_varlen(q, k, v, out=None, **kw):   # out=: writes_out, as FA3's
        assert kw["fa_version"] == 3
        calls.append((tuple(q.shape), tuple(k.shape), kw["window_size"]))
        return reference_flash_varlen(q, k, v, out=out, **kw)

    st = impl._tkv_state
    st.dense_attention = FlashVarlenAttention(fake_varlen, fa_version=3) if on else None
    try:
        yield calls
    finally:
        st.dense_attention = None


def long_continuation_step(impl, layer, shape, builder, window, CommonAttentionMetadata,
                           gather_kv, li):
    """One request alone, continuing a 20-token prefix with a 70-token chunk (longer than a
    query tile): the builder marks its prefix exact, and without a sliding window the kernels
    run its attention through SDPA over the decompressed prefix (CausalBias dispatch seen);
    equal to the reference either way."""
    from unittest import mock

    from torch.nn.attention.bias import CausalBias

    hq, hd, hkv, bs = impl.num_heads, impl.head_size, impl.num_kv_heads, 16
    ctx, ql = 20, 70
    cache = torch.zeros(shape, dtype=torch.uint8)
    bt = torch.tensor([[7, 2, 9, 4, 11, 0]], dtype=torch.int32)

    def slots(positions):
        return torch.tensor([int(bt[0, p // bs]) * bs + p % bs for p in positions],
                            dtype=torch.int64)
    kc = torch.randn(ctx, hkv, hd, dtype=torch.bfloat16)
    impl.do_kv_cache_update(layer, kc, torch.randn_like(kc), cache, slots(range(ctx)))
    q = torch.randn(ql, hq, hd, dtype=torch.bfloat16)
    k = torch.randn(ql, hkv, hd, dtype=torch.bfloat16)
    v = torch.randn(ql, hkv, hd, dtype=torch.bfloat16)
    sm = slots(range(ctx, ctx + ql))
    impl.do_kv_cache_update(layer, k, v, cache, sm)
    qsl = torch.tensor([0, ql], dtype=torch.int32)
    sl = torch.tensor([ctx + ql], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=sl, num_reqs=1,
        num_actual_tokens=ql, max_query_len=ql, max_seq_len=ctx + ql, block_table_tensor=bt,
        slot_mapping=sm, seq_lens_cpu_upper_bound=sl.clone())
    md = builder.build(0, cam)
    (run,) = md.prefill_runs
    assert md.num_prefills == 1 and run.max_prefix_len == ctx and run.prefix_exact, md
    out = torch.full((ql, hq, hd), float("nan"), dtype=torch.bfloat16)
    with mock.patch.object(CausalBias, "_dispatch", wraps=CausalBias._dispatch) as spy:
        impl.forward(layer, q, k, v, cache, md, output=out)
    flash = impl._tkv_state.dense_attention is not None   # then FlashAttention, not SDPA
    assert spy.call_count == (0 if window or flash else 1), (window, flash, spy.call_count)
    loader = impl._tkv_state.loader(bs)
    kcache, vcache = gather_kv(cache, loader, bt[0], ctx + ql)
    ref = reference(q, k, v, kcache, vcache, ctx, window, hd ** -0.5, decode=False)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    tag = "flash " if impl._tkv_state.dense_attention is not None else ""
    print(f"{tag}long continuation layer {li} window={window}: rel err {err:.2e}")
    return err


def prefix_hits_step(impl, layer, shape, builder, window, CommonAttentionMetadata, gather_kv,
                     li):
    """Two requests whose prompts start with cached blocks (prefix-cache hits: 16 and 32
    cached tokens) and chunks of 70 and 9 tokens: one prefill run of two rows with a prefix
    (no exact promise). Through FlashAttention (faked) they take the kernels' varlen path —
    ONE call over both prefixes packed with their chunks (``prefix_tokens`` = 48 from vLLM's
    CPU lengths: 48 + 79 key rows); with tkv's kernels the decompress-once Triton loop. Equal
    to the reference either way."""
    hq, hd, hkv, bs = impl.num_heads, impl.head_size, impl.num_kv_heads, 16
    ctx, q_lens = [16, 32], [70, 9]
    cache = torch.zeros(shape, dtype=torch.uint8)
    bt = torch.tensor([[5, 1, 8, 10, 3, 0], [2, 11, 6, 9, 0, 0]], dtype=torch.int32)

    def slots(r, positions):
        return torch.tensor([int(bt[r, p // bs]) * bs + p % bs for p in positions],
                            dtype=torch.int64)
    for r, c in enumerate(ctx):
        kc = torch.randn(c, hkv, hd, dtype=torch.bfloat16)
        impl.do_kv_cache_update(layer, kc, torch.randn_like(kc), cache, slots(r, range(c)))
    n = sum(q_lens)
    q = torch.randn(n, hq, hd, dtype=torch.bfloat16)
    k = torch.randn(n, hkv, hd, dtype=torch.bfloat16)
    v = torch.randn(n, hkv, hd, dtype=torch.bfloat16)
    sm = torch.cat([slots(r, range(c, c + ql)) for r, (c, ql) in enumerate(zip(ctx, q_lens,
                                                                               strict=True))])
    impl.do_kv_cache_update(layer, k, v, cache, sm)
    qsl = torch.tensor([0, 70, 79], dtype=torch.int32)
    sl = torch.tensor([c + ql for c, ql in zip(ctx, q_lens, strict=True)], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=sl, num_reqs=2,
        num_actual_tokens=n, max_query_len=70, max_seq_len=86, block_table_tensor=bt,
        slot_mapping=sm, seq_lens_cpu_upper_bound=sl.clone())
    md = builder.build(0, cam)
    (run,) = md.prefill_runs
    assert (md.num_prefills, run.max_prefix_len, run.prefix_tokens, run.prefix_exact,
            run.no_prefix) == (2, 32, 48, False, False), md
    out = torch.full((n, hq, hd), float("nan"), dtype=torch.bfloat16)
    st = impl._tkv_state
    impl.forward(layer, q, k, v, cache, md, output=out)
    loader = impl._tkv_state.loader(bs)
    worst = 0.0
    for r in range(2):
        a, b = int(qsl[r]), int(qsl[r + 1])
        kcache, vcache = gather_kv(cache, loader, bt[r], int(sl[r]))
        ref = reference(q[a:b], k[a:b], v[a:b], kcache, vcache, ctx[r], window, hd ** -0.5,
                        decode=False)
        err = (out[a:b].double() - ref).abs().max().item() / ref.abs().max().item()
        worst = max(worst, err)
    tag = "flash " if st.dense_attention is not None else ""
    print(f"{tag}prefix-cache hits layer {li} window={window}: rel err {worst:.2e}")
    return worst


def first_prefill_step(impl, layer, shape, builder, window, CommonAttentionMetadata, li):
    """A batch of first chunks only (the prefill bypass, ``no_prefix``) on a fresh cache: equal
    to the reference, and it compiles the prefix-reading variant once (``warm_prefix_variant``)
    without writing the cache."""
    hq, hd, hkv = impl.num_heads, impl.head_size, impl.num_kv_heads
    bs = 16
    cache = torch.zeros(shape, dtype=torch.uint8)
    q_lens = [5, 3]
    bt = torch.tensor([[3, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.int32)
    sm = torch.cat([torch.arange(ql, dtype=torch.int64) + int(bt[r, 0]) * bs
                    for r, ql in enumerate(q_lens)])
    n = sum(q_lens)
    q = torch.randn(n, hq, hd, dtype=torch.bfloat16)
    k = torch.randn(n, hkv, hd, dtype=torch.bfloat16)
    v = torch.randn(n, hkv, hd, dtype=torch.bfloat16)
    impl.do_kv_cache_update(layer, k, v, cache, sm)
    stored = cache.clone()
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32), num_reqs=2, num_actual_tokens=n,
        max_query_len=5, max_seq_len=5, block_table_tensor=bt, slot_mapping=sm,
        seq_lens_cpu_upper_bound=torch.tensor(q_lens, dtype=torch.int32))
    md = builder.build(0, cam)
    (run,) = md.prefill_runs
    assert md.num_prefills == 2 and run.no_prefix and run.max_query_len == 5, md
    impl._prefix_variant_warm = False
    out = torch.full((n, hq, hd), float("nan"), dtype=torch.bfloat16)
    impl.forward(layer, q, k, v, cache, md, output=out)
    assert impl._prefix_variant_warm, "prefix-reading prefill variant not warmed"
    assert torch.equal(cache, stored), "forward wrote the cache"
    worst = 0.0
    for r in range(2):
        a, b = int(qsl[r]), int(qsl[r + 1])
        empty = torch.zeros(0, hkv, hd, dtype=torch.float64)
        ref = reference(q[a:b], k[a:b], v[a:b], empty, empty, 0, window, hd ** -0.5,
                        decode=False)
        err = (out[a:b].double() - ref).abs().max().item() / ref.abs().max().item()
        tag = "flash " if impl._tkv_state.dense_attention is not None else ""
        print(f"{tag}first prefill layer {li} request {r}: rel err {err:.2e}")
        worst = max(worst, err)
    return worst


def padded_decode_step(B, impl, layer, cache, bt, seq_lens, slots, window, builder, loader,
                       gather_kv, CommonAttentionMetadata, li) -> float:
    """The next step as a CUDA-graph-padded uniform decode batch: requests 0 and 1 decode one
    token, rows 2 and 3 are padding (no tokens, seq_len 0, null block, slot -1) and must come
    out as zeros."""
    hq, hd, hkv = impl.num_heads, impl.head_size, impl.num_kv_heads
    q = torch.randn(4, hq, hd, dtype=torch.bfloat16)
    k = torch.randn(4, hkv, hd, dtype=torch.bfloat16)
    v = torch.randn(4, hkv, hd, dtype=torch.bfloat16)
    sl = [seq_lens[0] + 1, seq_lens[1] + 1, 0, 0]
    sm = torch.cat([slots(0, [seq_lens[0]]), slots(1, [seq_lens[1]]),
                    torch.full((2,), -1, dtype=torch.int64)])
    impl.do_kv_cache_update(layer, k, v, cache, sm)
    pbt = torch.cat([bt[:2], torch.zeros(2, bt.shape[1], dtype=torch.int32)])
    qsl = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(sl, dtype=torch.int32), num_reqs=4, num_actual_tokens=4,
        max_query_len=1, max_seq_len=max(sl), block_table_tensor=pbt, slot_mapping=sm)
    md = builder.build(0, cam)
    assert (md.num_decodes, md.decode_query_len, md.num_prefills) == (4, 1, 0), md
    out = torch.full((4, hq, hd), float("nan"), dtype=torch.bfloat16)
    impl.forward(layer, q, k, v, cache, md, output=out)
    assert torch.equal(out[2:].float(), torch.zeros(2, hq, hd)), "padding rows not zero"
    worst = 0.0
    for r in range(2):
        kc, vcache = gather_kv(cache, loader, pbt[r], sl[r])
        ref = reference(q[r:r + 1], k[r:r + 1], v[r:r + 1], kc, vcache, sl[r] - 1, window,
                        hd ** -0.5, decode=True)
        err = (out[r:r + 1].double() - ref).abs().max().item() / ref.abs().max().item()
        print(f"padded decode layer {li} request {r}: rel err {err:.2e}")
        worst = max(worst, err)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
