"""The hand-written CUDA split kernel (``decode(kernel="cuda")``, tkv.kernels.cuda_decode).

On the CPU: every supported configuration compiles with NVRTC for sm_90 (no GPU needed) within
its register budget, and the scope checks refuse by name. On a GPU: the float64 oracle and the
Triton kernel agree with it on ragged, randomly paged batches; CUDA-graph replay equals eager.
"""

import re
import subprocess
from pathlib import Path

import pytest
import torch

from tkv.codec import TurboKVCodec
from tkv.codec.errors import ShapeError
from tkv.kernels import TkvLoader, Workspace, _nvrtc, cuda_decode, decode
from tkv.kernels._util import UnsupportedKernelError, interpreting
from tkv.kernels.reference import decode_reference
from tkv.kernels.testing import fill_cache, make_cache, make_paged_batch, tuning

GPU = torch.cuda.is_available() and not interpreting()

gpu_only = pytest.mark.skipif(not GPU, reason="needs CUDA")


@pytest.fixture(autouse=True)
def _short_profile(monkeypatch):
    """Each test here names its whole tuning: the context profile (default ``auto``: pair
    tables, 8 warps, teams) adds nothing, as under ``TKV_DECODE_CONTEXT=short``; the profiles
    themselves are tested by name."""
    monkeypatch.setattr(cuda_decode, "DECODE_CONTEXT", "short")


def _cuobjdump() -> Path | None:
    import triton
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return p if p.exists() else None


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only PyTorch has no NVRTC")
@pytest.mark.parametrize("d,group,q_dtype,dot,qrot,epilogue,tune", [
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {}),
    (128, 4, torch.float32, torch.bfloat16, False, 0, {"sink": True}),
    (128, 8, torch.float32, torch.bfloat16, False, 0, {}),
    (128, 4, torch.float32, torch.bfloat16, False, 0, {"sub": 1, "stages": 3}),
    (64, 3, torch.float16, torch.float16, True, 1, {}),
    (64, 1, torch.float32, torch.bfloat16, False, 0, {"sub": 2, "stages": 6}),
    (256, 7, torch.bfloat16, torch.bfloat16, True, 2, {}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"lut": 1}),
    (64, 8, torch.float32, torch.float16, False, 0, {"lut": 1, "sink": True}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"lut": 1, "warps": 8}),
    (256, 4, torch.bfloat16, torch.bfloat16, True, 0, {"lut": 1, "warps": 8}),
    # the balanced (stream-K) schedule
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"balanced": True}),
    (128, 8, torch.float16, torch.float16, True, 1, {"balanced": True, "sink": True}),
    (64, 3, torch.bfloat16, torch.bfloat16, True, 2, {"balanced": True, "lut": 1}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"balanced": True, "lut": 1, "warps": 8}),
    # the first ring groups issued before the query prologue (its rows in their own area)
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"early": 1}),
    (64, 8, torch.float32, torch.float16, False, 0, {"early": 1, "sink": True}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"early": 1, "lut": 1, "warps": 8}),
    (256, 7, torch.bfloat16, torch.bfloat16, True, 1, {"early": 1, "lut": 1}),
    (256, 8, torch.bfloat16, torch.bfloat16, True, 2, {"early": 1}),   # 48 KB static: rows in
    (256, 8, torch.float32, torch.bfloat16, True, 1, {"early": 1, "balanced": True}),   # merge
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"early": 1, "balanced": True}),
    # two teams of 4 warps (one KV head each) for short splits, 8 warps per head for long ones
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"lut": 1, "warps": 8, "team_steps": 64}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2,
     {"lut": 1, "warps": 8, "team_steps": 64, "early": 1}),
    (64, 8, torch.float32, torch.float16, False, 0,
     {"lut": 1, "warps": 8, "team_steps": 64, "early": 1, "sink": True}),
    (128, 8, torch.float16, torch.float16, False, 1, {"lut": 1, "warps": 8, "team_steps": 9}),
    # several splits merged in the kernel by the last one (MERGE_SPLITS)
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"merge_splits": True}),
    (64, 8, torch.float32, torch.float16, False, 1, {"merge_splits": True, "sink": True}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2,
     {"lut": 1, "warps": 8, "team_steps": 128, "merge_splits": True}),
    (256, 8, torch.bfloat16, torch.bfloat16, True, 2, {"merge_splits": True}),
    (128, 4, torch.bfloat16, torch.bfloat16, True, 2, {"lut": 1, "warps": 8, "merge_splits": True}),
    (256, 4, torch.bfloat16, torch.bfloat16, True, 2, {"early": 1, "merge_splits": True}),
    (256, 8, torch.bfloat16, torch.bfloat16, True, 2, {"early": 1, "lut": 1})])
def test_compiles_offline_within_its_register_budget(d, group, q_dtype, dot, qrot, epilogue,
                                                     tune, tmp_path):
    """NVRTC compiles the kernel for sm_90 on any machine (no GPU needed), with the query
    rotation and each epilogue; at head_dim ≤ 128 it fits its register budget (``MIN_CTAS``
    CTAs of ``WARPS`` warps per SM: 128 registers at 4 × 4) without local memory or a stack."""
    tune = dict(tune)
    sinks = {"k_sink_offset": torch.randn(d), "v_sink_offset": torch.randn(d)} \
        if tune.pop("sink", False) else {}
    ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, **sinks), 2, 16)
    defs = cuda_decode.defines(ld, d, group, q_dtype, dot, qrot=qrot, epilogue=epilogue,
                               out_dtype=q_dtype, **tune)
    assert defs["K_SYM"] == defs["V_SYM"] == 1   # the default codebooks are antisymmetric
    assert defs["K_SINK"] == defs["V_SINK"] == int(bool(sinks))
    cubin = _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, defs, "90")
    assert cubin[:4] == b"\x7fELF"
    tool = _cuobjdump()
    if tool is None:
        return
    (tmp_path / "k.cubin").write_bytes(cubin)
    res = subprocess.run([str(tool), "-res-usage", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stdout
    if d > 128:   # no register budget to hold there (2 CTAs), but nothing on the stack
        assert "LOCAL:0" in res and "STACK:0" in res, res
        return
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert regs <= min(255, 65536 // (32 * defs["WARPS"] * defs["MIN_CTAS"])), res
    assert "LOCAL:0" in res, res
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    # 8 warps at 128 registers keep the loop's trip count on the stack (one L1-resident load
    # per 32 tokens), with the balanced schedule also its segment state across the loop
    # (spilled at segment boundaries only), with teams the team's head and rank (read in
    # the prologue and the epilogue), with the in-kernel merge of splits values it reads
    # after the loop (the main loop keeps its one load); nothing else may spill
    assert stack <= (0 if defs["WARPS"] == 4 else 16 if defs["BALANCED"] or defs["TEAMS"]
                     or defs["MERGE_SPLITS"] else 8), res


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only PyTorch has no NVRTC")
@pytest.mark.parametrize("tune", [{}, {"lut": 1, "warps": 8, "team_steps": 128}])
def test_probe_build_compiles_and_leaves_the_default_alone(tune):
    """The timeline probe (``PROBE=1``) compiles with and without teams; a build without it
    is the same cubin whether the define is absent or 0 (no probe code in default builds);
    the balanced schedule refuses it at compile time."""
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4), 8, 16)
    defs = cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, qrot=True,
                               epilogue=2, out_dtype=torch.bfloat16, **tune)
    plain = _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, defs, "90")
    assert _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, {**defs, "PROBE": 0},
                                "90") == plain
    probe = _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, {**defs, "PROBE": 1},
                                 "90")
    assert probe[:4] == b"\x7fELF" and probe != plain
    bal = cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, qrot=True,
                              epilogue=2, out_dtype=torch.bfloat16, balanced=True)
    with pytest.raises(_nvrtc.CudaCompileError, match="probe"):
        _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, {**bal, "PROBE": 1}, "90")


def test_probe_needs_a_captured_split_launch():
    """``testing.probe_cuda_decode`` refuses by name when no CUDA split launch was captured
    (the call ran another kernel) and for the balanced schedule."""
    from tkv.kernels.testing import probe_cuda_decode
    with pytest.raises(ShapeError, match="captured"):
        probe_cuda_decode({})
    with pytest.raises(ShapeError, match="split schedule"):
        probe_cuda_decode({"defs": {"BALANCED": 1}, "grid": (1, 1, 1), "args": ()})


def test_compile_error_is_named():
    """A source NVRTC refuses raises CudaCompileError with the log, not a bare RuntimeError."""
    if torch.version.cuda is None:
        pytest.skip("a CPU-only PyTorch has no NVRTC")
    with pytest.raises(_nvrtc.CudaCompileError, match=r"HEAD_DIM|error"):
        _nvrtc.compile_cubin(cuda_decode.SOURCE, cuda_decode.ENTRY, {"GROUP": 4}, "90")


def test_refuses_what_it_cannot_serve():
    """Outside its scope the CUDA kernel refuses by name before any launch."""
    dev = "cuda" if GPU else "cpu"
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device=dev), 2, 16)
    check = cuda_decode.check_supported
    if not GPU:
        with pytest.raises(UnsupportedKernelError, match="CUDA device"):
            check(ld, "cpu", 128, 4, torch.bfloat16)
    odd = TkvLoader(TurboKVCodec(128, k_bits=3, v_bits=4, device=dev), 2, 16)
    with pytest.raises(UnsupportedKernelError, match="4-bit"):
        check(odd, dev, 128, 4, torch.bfloat16)
    with pytest.raises(UnsupportedKernelError, match="head_dim"):
        check(TkvLoader(TurboKVCodec(96, k_bits=4, v_bits=4, device=dev), 2, 16), dev, 96, 4,
              torch.bfloat16)
    with pytest.raises(UnsupportedKernelError, match="8 query heads"):
        check(ld, dev, 128, 9, torch.bfloat16)
    with pytest.raises(UnsupportedKernelError, match="multiple of 16"):
        check(TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device=dev), 2, 8), dev, 128, 4,
              torch.bfloat16)
    with pytest.raises(UnsupportedKernelError, match="byte tables"):
        check(TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device=dev), 2, 16,
                        lookup="pair"), dev, 128, 4, torch.bfloat16)


def _case(d, hkv, block, lens, seed=0, dtype=torch.bfloat16, **codec_kw):
    torch.manual_seed(seed)
    ld = TkvLoader(TurboKVCodec(d, k_bits=4, v_bits=4, device="cuda", **codec_kw), hkv, block)
    batch = make_paged_batch(lens, block, "cuda")
    cache = make_cache(ld, batch.num_blocks, "cuda")   # poisoned: unused slots hold garbage
    for i, n in enumerate(lens):
        kv = torch.randn(2, n, hkv, d, device="cuda", dtype=dtype)
        fill_cache(ld, cache, kv[0], kv[1], batch.slots(i))
    return ld, batch, cache


def _capture(run):
    """``run`` warmed up on a side stream, then captured: the CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g


def _replays_follow_lengths(g, run, batch, out, length_sets):
    """Graph ``g`` (captured from ``run``, which writes ``out``) replayed under each of
    ``length_sets`` (written into ``batch.seq_lens``) equals ``run`` eagerly on them."""
    for new in length_sets:
        batch.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        run()
        eager = out.clone()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), new


def _rel_rows(out, ref):
    """Largest per-(sequence, head) relative error."""
    err = (out.double() - ref).flatten(0, 1).norm(dim=-1)
    return (err / ref.flatten(0, 1).norm(dim=-1).clamp_min(1e-30)).max().item()


@gpu_only
@pytest.mark.parametrize("d,hkv,group,block,window,dtype", [
    (128, 8, 4, 16, 0, torch.bfloat16), (128, 2, 8, 32, 0, torch.bfloat16),
    (64, 3, 3, 16, 100, torch.bfloat16), (64, 4, 1, 64, 0, torch.float16),
    (256, 2, 7, 128, 0, torch.bfloat16), (128, 1, 4, 16, 33, torch.float16)])
@pytest.mark.parametrize("tune,codebook", [({}, None), ({"lut": 1}, None), ({"lut": 1}, "beta"),
                                           ({"lut": 1, "warps": 8}, None), ({"early": 1}, None),
                                           ({"lut": 1, "warps": 8, "early": 1}, "beta"),
                                           # TKV_DECODE_CONTEXT=auto's build (the default)
                                           ({"lut": 1, "warps": 8, "team_steps": 128}, None)])
def test_matches_oracle_and_triton(d, hkv, group, block, window, dtype, tune, codebook):
    """Against the float64 oracle (per row, within bf16/fp16 rounding) and the Triton split
    kernel (same inputs), at the workspace's split count and at 1 and 8 splits: lengths 1, 15,
    16, 17, tails, random pages, GQA 1-8, windows, fp16; with the register lookups (the
    default) and the shared pair tables (``lut=1``: one table, or K's and V's own when the
    codebooks differ; 4 or 8 warps per CTA); with the first pages issued before the query
    prologue (``early=1``)."""
    lens = [1, 37, 300, 1024, 77, 16, 17, 15]
    kw = {"k_codebook": codebook} if codebook else {}
    ld, batch, cache = _case(d, hkv, block, lens, dtype=dtype, **kw)
    defs = cuda_decode.defines(ld, d, group, dtype, dtype, **tune)
    lut = tune.get("lut", 0)
    assert defs["TAB_SAME"] == int(lut and not kw)   # one table for both sides
    assert defs["TAB_BYTES"] == (0 if not lut else 32768 if not kw else 65536)
    q = torch.randn(len(lens), hkv * group, d, device="cuda", dtype=dtype)
    ws = Workspace(8, 64, 256, "cuda")
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
    tri = decode(*args, window=window).double()
    for splits in (None, 1, 8):
        with tuning(cuda_decode, **tune):
            out = decode(*args, window=window, kernel="cuda", num_splits=splits)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert _rel_rows(out, ref) < 2.5e-2, splits
        assert _rel_rows(out, tri) < 1e-2, splits


@gpu_only
def test_both_lookups_agree_bit_for_bit():
    """The antisymmetric-table lookup (default codebooks) and the general 16-entry lookup give
    the same bits: the kernel built with each equals the other exactly."""
    ld, batch, cache = _case(128, 4, 16, [500, 3, 129])
    q = torch.randn(3, 16, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(4, 16, 128, "cuda")
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    assert cuda_decode._antisymmetric(ld, "k", torch.bfloat16)
    sym = decode(*args, kernel="cuda")
    for s in "kv":   # as if the codebooks were not antisymmetric: the general lookup
        ld._prmt_antisymmetric[s, torch.bfloat16] = False
    general = decode(*args, kernel="cuda")
    assert torch.equal(sym, general)


@gpu_only
def test_graph_replay_equals_eager_and_broken_lengths_are_nan():
    """Captured in a CUDA graph and replayed, the output equals eager; a length past the block
    table's capacity gives NaN rows (as the Triton kernel) and reads nothing outside it."""
    ld, batch, cache = _case(128, 8, 16, [700, 5, 2000])
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(4, 32, 128, "cuda")
    out = torch.empty_like(q)
    run = lambda: decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out,
                         kernel="cuda")
    run()
    eager = out.clone()
    g = _capture(run)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    batch.seq_lens[1] = 10**6
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.equal(out[0], eager[0])


@gpu_only
@pytest.mark.parametrize("splits", [1, 4])
def test_rotation_options_match_triton(splits):
    """The query rotated in the kernel or beforehand (``query_rotated``, a float32 or bf16
    rotated query), and the output unrotated in the kernel or left rotated
    (``output_rotated``): each equals the Triton kernel with the same options, through the
    single-split epilogues (1 split) and the reduce pass (4)."""
    ld, batch, cache = _case(128, 4, 32, [900, 2, 64])
    q = torch.randn(3, 16, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(4, 16, 128, "cuda")
    args = (cache, batch.block_table, batch.seq_lens, ld, ws)
    qr = (q.float().reshape(-1, 128) @ ld.q_in[:128, :128].float()).reshape(q.shape)
    for opts, query in (({}, q), ({"output_rotated": True}, q),
                        ({"query_rotated": True}, qr),
                        ({"query_rotated": True}, qr.to(torch.bfloat16)),
                        ({"fused_query_rotation": False}, q)):
        tri = decode(query, *args, num_splits=splits, **opts).double()
        out = decode(query, *args, num_splits=splits, kernel="cuda", **opts)
        assert torch.isfinite(out).all()
        assert _rel_rows(out, tri) < 1e-2, opts


_MIXED = [1, 37, 300, 1024, 77, 16, 17, 15, 2500, 129]   # short splits (teams) and long ones


@gpu_only
@pytest.mark.parametrize("d,hkv,group,block,window,early,sink", [
    (128, 8, 4, 16, 0, 0, False), (128, 3, 8, 32, 0, 1, False), (64, 4, 1, 64, 100, 0, True),
    (64, 5, 3, 16, 0, 1, True), (128, 2, 7, 128, 33, 1, False)])
def test_teams_match_oracle_and_eight_warps(d, hkv, group, block, window, early, sink,
                                            monkeypatch):
    """Two teams of 4 warps per CTA (``team_steps``; one KV head each, the odd head's CTA
    exits) for splits of at most 8 steps, 8 warps per head for longer ones, in one launch: a
    batch mixing both against the float64 oracle and the 8-warp build without teams, at the
    workspace's split count and at 1 and 8 splits (partial rows and the reduce pass), the
    output unrotated and left rotated; an odd number of KV heads (the last team idle), GQA
    1-8, windows, sink offsets, ``early`` 0 / 1."""
    monkeypatch.setattr(cuda_decode, "TEAM_FILL", 0)   # teams whatever the grid's size
    kw = {"k_sink_offset": 3 * torch.randn(d), "v_sink_offset": 3 * torch.randn(d)} \
        if sink else {}
    ld, batch, cache = _case(d, hkv, block, _MIXED, **kw)
    q = torch.randn(len(_MIXED), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(16, 64, 256, "cuda")
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
    tune = {"lut": 1, "warps": 8, "early": early}
    for splits in (None, 1, 8):
        for opts in ({}, {"output_rotated": True}):
            with tuning(cuda_decode, **tune):
                base = decode(*args, window=window, kernel="cuda", num_splits=splits, **opts)
            with tuning(cuda_decode, team_steps=8, **tune):
                out = decode(*args, window=window, kernel="cuda", num_splits=splits, **opts)
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
            assert _rel_rows(out, base.double()) < 1e-2, (splits, opts)
            if not opts:
                assert _rel_rows(out, ref) < 2.5e-2, splits


@gpu_only
def test_teams_graph_replay_follows_new_lengths(monkeypatch):
    """Captured once, replayed with lengths that move sequences between teams and 8 warps
    (the choice is made on the device), the teams build equals eager on the same lengths."""
    monkeypatch.setattr(cuda_decode, "TEAM_FILL", 0)
    lens = [3000, 7, 500, 64]
    ld, batch, cache = _case(128, 8, 16, lens)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(4, 32, 128, "cuda")
    out = torch.empty_like(q)
    with tuning(cuda_decode, lut=1, warps=8, team_steps=16):
        run = lambda: decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out,
                             kernel="cuda", num_splits=1)
        _replays_follow_lengths(_capture(run), run, batch, out,
                                ([3000, 7, 500, 64], [100, 2900, 1, 500], [1, 1, 1, 3000]))


@gpu_only
@pytest.mark.parametrize("tune,splits", [({}, 2), ({"lut": 1, "warps": 8, "team_steps": 16}, 1)])
def test_timeline_probe_writes_the_same_output_and_ordered_times(tune, splits, monkeypatch):
    """The probe build (``testing.probe_cuda_decode``) writes exactly the output of the launch
    it repeats, and each working CTA's timestamps are ordered (entry ≤ prologue ≤ first wait ≤
    loop end ≤ warps done ≤ exit, the ninth wait inside the loop when there is one), with its
    SM id and warp 0's steps; a team's idle CTA has only entry and exit."""
    from tkv.kernels.testing import capture_cuda_decode_launch, probe_cuda_decode
    monkeypatch.setattr(cuda_decode, "TEAM_FILL", 0)
    lens = [3000, 7, 500, 64]
    ld, batch, cache = _case(128, 8, 16, lens)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(4, 32, 128, "cuda")
    part_o, part_lse = ws.partials(4, 32, splits, 128)
    out = torch.empty_like(q)
    with tuning(cuda_decode, **tune):
        launch = capture_cuda_decode_launch(
            lambda: decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out,
                           kernel="cuda", num_splits=splits))
        torch.cuda.synchronize()
        want = (out.clone(), part_o.clone(), part_lse.clone())
        out.fill_(float("nan"))
        part_o.fill_(float("nan"))
        part_lse.fill_(float("nan"))
        p = probe_cuda_decode(launch)
    assert torch.equal(out, want[0])   # one split, or several merged in the kernel
    if splits > 1:   # the partial rows the merge read
        assert torch.equal(part_o, want[1]) and torch.equal(part_lse, want[2])
    grid = launch["grid"]
    assert p.shape == (grid[0] * grid[1] * grid[2], 8)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert ((p[:, 7] & 0xffffffff) < sms).all()
    assert (p[:, 0] > 0).all() and (p[:, 0] <= p[:, 6]).all()
    ran = p[:, 1] > 0   # every CTA but a team's idle one (an empty split runs its epilogue)
    for a, b in ((0, 1), (1, 4), (4, 5), (5, 6)):
        assert (p[ran, a] <= p[ran, b]).all(), (a, b)
    t = p[(p[:, 7] >> 32) > 0]   # warp 0 has steps: its first wait is inside its loop
    assert t.shape[0] and (t[:, 1] <= t[:, 2]).all() and (t[:, 2] <= t[:, 4]).all()
    nine = t[:, 3] > 0
    assert ((t[nine, 2] <= t[nine, 3]) & (t[nine, 3] <= t[nine, 4])).all()
    assert nine.any()   # the 3,000-token sequence's warps pass their ninth wait
    assert (p[~ran, 1:6] == 0).all()
    assert bool((~ran).any()) == bool(tune)   # teams: the odd heads' CTAs of short sequences


@gpu_only
@pytest.mark.parametrize("tune", [{}, {"lut": 1, "warps": 8, "team_steps": 128}])
@pytest.mark.parametrize("sink", [False, True])
def test_splits_merged_in_the_kernel_equal_the_reduce_pass(tune, sink, monkeypatch):
    """Several splits merged by the split that finishes last (``MERGE_SPLITS``, the default)
    equal the reduce kernel's merge (``cuda_decode.MERGE_SPLITS = False``) to rounding and the
    float64 oracle, at 2, 8 and 32 splits, the output unrotated and left rotated, with teams
    (3 KV heads: an idle team) and sink offsets; the counters are left zero; a CUDA graph
    replayed under new lengths equals eager."""
    monkeypatch.setattr(cuda_decode, "TEAM_FILL", 0)
    monkeypatch.setattr(cuda_decode, "MERGE_MAX_SPLITS", 32)   # the merge at every count here
    kw = {"k_sink_offset": 3 * torch.randn(128), "v_sink_offset": 3 * torch.randn(128)} \
        if sink else {}
    ld, batch, cache = _case(128, 3, 16, _MIXED, **kw)
    q = torch.randn(len(_MIXED), 12, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(16, 64, 256, "cuda")
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld)
    with tuning(cuda_decode, **tune):
        for splits in (2, 8, 32):
            for opts in ({}, {"output_rotated": True}):
                merged = torch.full_like(q, float("nan"))   # the merge must write every row
                decode(*args, out=merged, kernel="cuda", num_splits=splits, **opts)
                torch.cuda.synchronize()
                assert not ws._counters.any()
                monkeypatch.setattr(cuda_decode, "MERGE_SPLITS", False)
                reduced = decode(*args, kernel="cuda", num_splits=splits, **opts)
                monkeypatch.setattr(cuda_decode, "MERGE_SPLITS", True)
                assert torch.isfinite(merged).all()
                assert _rel_rows(merged, reduced.double()) < 5e-3, (splits, opts)
                if not opts:
                    assert _rel_rows(merged, ref) < 2.5e-2, splits
        out = torch.empty_like(q)
        run = lambda: decode(*args, out=out, kernel="cuda", num_splits=8)
        _replays_follow_lengths(_capture(run), run, batch, out,
                                (_MIXED, _MIXED[::-1], [1] * len(_MIXED)))


def test_merge_splits_needs_counters_and_an_output_epilogue():
    """The in-kernel merge is refused by name without counters for every (sequence, KV
    head) pair, and at build time without an output epilogue or with the balanced schedule."""
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4), 2, 16)
    q = torch.zeros(3, 8, 128)
    with pytest.raises(ShapeError, match="counters"):
        cuda_decode.launch_split(q, None, None, 1, None, ld, None, None, 1.0, 0, group=4,
                                 splits=4, dot_dtype=torch.bfloat16, epilogue=2)
    with pytest.raises(ShapeError, match="counters"):
        cuda_decode.launch_split(q, None, None, 1, None, ld, None, None, 1.0, 0, group=4,
                                 splits=4, dot_dtype=torch.bfloat16, epilogue=1,
                                 counters=torch.zeros(5, dtype=torch.int32))
    for kw in ({"epilogue": 0}, {"epilogue": 2, "balanced": True}):
        with pytest.raises(ShapeError, match="merge_splits"):
            cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, merge_splits=True,
                                **kw)


def test_team_steps_rule():
    """``team_steps_for``: the threshold passes to the kernel only where the CTAs left working
    with every sequence in teams (⌈KV heads / 2⌉ per sequence and split) fill ``TEAM_FILL`` of
    a wave; never with one KV head; the build refuses teams without 8 warps or with the
    balanced schedule."""
    slots = 132 * 2
    assert cuda_decode.team_steps_for(64, 256, 8, 1, slots) == 64    # 1024 working CTAs
    assert cuda_decode.team_steps_for(64, 64, 8, 1, slots) == 64     # 256 ≥ 0.875 · 264
    assert cuda_decode.team_steps_for(64, 32, 8, 1, slots) == 0      # 128: half a wave
    assert cuda_decode.team_steps_for(64, 32, 8, 2, slots) == 64
    assert cuda_decode.team_steps_for(64, 100, 3, 1, slots) == 0     # 200 < 231
    assert cuda_decode.team_steps_for(64, 1000, 1, 1, slots) == 0    # one head: no pair
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4), 8, 16)
    d = cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, lut=1, warps=8,
                            team_steps=64)
    assert d["TEAMS"] == 1 and "TEAM_STEPS" not in d   # the threshold is an argument
    for bad in ({"lut": 1, "team_steps": 64}, {"lut": 1, "warps": 8, "team_steps": -1},
                {"lut": 1, "warps": 8, "team_steps": True},
                {"lut": 1, "warps": 8, "team_steps": 64, "balanced": True, "epilogue": 1}):
        with pytest.raises(ShapeError, match="team_steps"):
            cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, **bad)


def test_workspace_cuda_split_rule():
    """``Workspace.cuda_splits_for``: the largest power of two whose grid fits one wave of the
    configuration's resident CTAs (``target_programs / 4`` SMs × ``ctas_per_sm``), one split
    when even that overflows, never more than the Triton rule (whose partial rows the
    workspace holds); the measured bests of session 36 (H100, 132 SMs)."""
    ws = Workspace(256, 32, 128, "cpu", target_programs=528)   # 132 SMs × 4
    # the register lookups: 4 CTAs per SM
    assert ws.cuda_splits_for(32, 8) == 2       # 512 CTAs ≤ 528
    assert ws.cuda_splits_for(8, 8) == 8
    assert ws.cuda_splits_for(64, 8) == 1       # 512 CTAs
    assert ws.cuda_splits_for(256, 8) == 1
    assert ws.cuda_splits_for(1, 8) == 32       # 528 / 8 = 66 → 64, capped at max_splits
    # the pair tables (3 per SM) and their 8-warp build (2 per SM)
    assert ws.cuda_splits_for(32, 8, 3) == 1    # 256 ≤ 396 < 512
    assert ws.cuda_splits_for(32, 8, 2) == 1
    assert ws.cuda_splits_for(8, 8, 2) == 4     # 256 ≤ 264
    assert ws.cuda_splits_for(128, 8, 2) == 1
    off = Workspace(256, 32, 128, "cpu", target_programs=528, single_split_ctas=0)
    for n in range(1, 257):
        for hkv in (1, 3, 8):
            for occ in (1, 2, 3, 4):
                got = ws.cuda_splits_for(n, hkv, occ)
                assert 1 <= got <= ws.splits_for(n, hkv)
                assert got == 1 or n * hkv * got <= 132 * occ   # one wave at most
                # one split switched off (TKV_DECODE_SINGLE_SPLIT=0): at least min_splits
                assert off.min_splits <= off.cuda_splits_for(n, hkv, occ) <= \
                    off.splits_for(n, hkv)


def test_context_profile_sets_the_tuning_and_its_occupancy(monkeypatch):
    """TKV_DECODE_CONTEXT: ``auto`` (default) builds the pair tables with 8 warps and two teams
    of 4 for short splits at head_dim ≤ 128 (2 CTAs per SM), the register lookups at 256;
    ``short`` keeps the register lookups (4 CTAs per SM), ``long`` the pair tables with 8 warps
    (4 at head_dim 256); :func:`cuda_decode.resident_ctas` is the register budget off a GPU."""
    assert cuda_decode.decode_context_from_env({}) == "auto"
    assert cuda_decode.decode_context_from_env({"TKV_DECODE_CONTEXT": " Long"}) == "long"
    assert cuda_decode.decode_context_from_env({"TKV_DECODE_CONTEXT": "SHORT"}) == "short"
    with pytest.raises(cuda_decode.DecodeContextConfigError, match="TKV_DECODE_CONTEXT"):
        cuda_decode.decode_context_from_env({"TKV_DECODE_CONTEXT": "32k"})
    auto = {"lut": 1, "warps": 8, "team_steps": cuda_decode.TEAM_STEPS}
    assert cuda_decode.context_tuning(128, "auto") == cuda_decode.context_tuning(64, "auto") == auto
    assert cuda_decode.context_tuning(256, "auto") == {}
    assert cuda_decode.context_tuning(128, "short") == {}
    assert cuda_decode.context_tuning(128, "long") == {"lut": 1, "warps": 8}
    assert cuda_decode.context_tuning(256, "long") == {"lut": 1, "warps": 4}
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4), 8, 16)
    assert cuda_decode.resident_ctas(ld, 128, 4, torch.bfloat16, "cpu") == 4   # short
    with tuning(cuda_decode, lut=1, warps=8):
        assert cuda_decode.resident_ctas(ld, 128, 4, torch.bfloat16, "cpu") == 2
    for context, ctas in (("auto", 2), ("long", 2), ("short", 4)):
        monkeypatch.setattr(cuda_decode, "DECODE_CONTEXT", context)
        assert cuda_decode.launch_tuning(128) == cuda_decode.context_tuning(128, context)
        assert cuda_decode.resident_ctas(ld, 128, 4, torch.bfloat16, "cpu") == ctas


@pytest.mark.parametrize("raw,want", [(None, "split"), ("", "split"), (" Balanced ", "balanced"),
                                      ("split", "split"), ("stream-k", None), ("1", None)])
def test_decode_schedule_env(raw, want):
    """TKV_DECODE_SCHEDULE: split (default) or balanced, any case; anything else a named
    error."""
    env = {} if raw is None else {"TKV_DECODE_SCHEDULE": raw}
    if want is None:
        with pytest.raises(cuda_decode.DecodeScheduleConfigError, match="TKV_DECODE_SCHEDULE"):
            cuda_decode.decode_schedule_from_env(env)
    else:
        assert cuda_decode.decode_schedule_from_env(env) == want


def test_tuning_keywords_are_validated():
    """A tuning keyword the kernel's ring cannot hold is a named error, not a bad launch."""
    from tkv.codec.errors import ShapeError
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4), 2, 16)
    for bad in ({"sub": 2, "stages": 1}, {"sub": 3}, {"sub": 2, "stages": 5},
                {"stages": 16}, {"min_ctas": 9}, {"lut": 2}, {"warps": 8}, {"lut": 1, "warps": 6}):
        with pytest.raises(ShapeError, match="tuning"):
            cuda_decode.defines(ld, 128, 4, torch.float32, torch.bfloat16, **bad)
    with pytest.raises(ShapeError, match="balanced"):   # it writes the output: epilogue 1 / 2
        cuda_decode.defines(ld, 128, 4, torch.float32, torch.bfloat16, balanced=True)


@gpu_only
@pytest.mark.parametrize("tune", [{}, {"lut": 1}, {"lut": 1, "warps": 8}])
def test_ctas_per_sm_is_the_occupancy_the_budgets_allow(tune):
    """``cuda_decode.ctas_per_sm`` (the driver's occupancy calculator): at least the register
    budget (``MIN_CTAS``) where the shared memory allows that many, never more than the
    shared memory allows."""
    ld = TkvLoader(TurboKVCodec(128, k_bits=4, v_bits=4, device="cuda"), 8, 16)
    defs = cuda_decode.defines(ld, 128, 4, torch.bfloat16, torch.bfloat16, **tune)
    n = cuda_decode.ctas_per_sm(defs, torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    per_cta = defs["DYN_BYTES"] + 1024   # + the driver's reserved shared memory per CTA
    smem_bound = props.shared_memory_per_multiprocessor // per_cta if defs["DYN_BYTES"] else 8
    assert 1 <= n <= smem_bound
    assert n >= min(defs["MIN_CTAS"], smem_bound)
    with tuning(cuda_decode, **tune):   # the host-side count the split rule uses agrees
        assert cuda_decode.resident_ctas(ld, 128, 4, torch.bfloat16, torch.device("cuda")) == n


_SKEWED = [5000, 1, 37, 0, 300, 16, 17, 15, 1024, 77]   # one long sequence, lengths 0 and 1


@gpu_only
@pytest.mark.parametrize("d,hkv,group,block,window,tune,min_steps", [
    (128, 8, 4, 16, 0, {}, None), (128, 8, 4, 16, 0, {}, 1), (64, 3, 3, 16, 100, {}, None),
    (128, 2, 8, 32, 0, {"lut": 1}, 1), (128, 4, 4, 16, 33, {"lut": 1, "warps": 8}, None),
    (256, 2, 7, 128, 0, {}, 2), (64, 4, 1, 64, 0, {"lut": 1}, 1),
    (128, 8, 4, 16, 0, {"early": 1}, 1), (64, 3, 3, 16, 100, {"lut": 1, "early": 1}, 2)])
def test_balanced_schedule_matches_oracle_and_split(d, hkv, group, block, window, tune,
                                                    min_steps, monkeypatch):
    """The balanced (stream-K) schedule on a skewed batch — one long sequence among short
    ones, lengths 0 and 1, tails, random pages, windows, GQA 1-8 — against the float64 oracle
    and the split schedule (one split), unrotated and left rotated; ``min_steps`` 1 / 2 cuts
    the pairs into many parts (every merge path: first / middle / last parts, CTAs inside one
    pair, CTAs spanning several)."""
    if min_steps is not None:
        monkeypatch.setattr(cuda_decode, "MIN_STEPS", min_steps)
    ld, batch, cache = _case(d, hkv, block, _SKEWED)
    q = torch.randn(len(_SKEWED), hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(16, 64, 256, "cuda")
    args = (q, cache, batch.block_table, batch.seq_lens, ld, ws)
    ref = decode_reference(q, cache, batch.block_table, batch.seq_lens, ld, window=window)
    for opts in ({}, {"output_rotated": True}):
        with tuning(cuda_decode, **tune):
            out = decode(*args, window=window, kernel="cuda", schedule="balanced", **opts)
            split = decode(*args, window=window, kernel="cuda", num_splits=1, **opts)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert _rel_rows(out, split.double()) < 1e-2, opts
        if not opts:
            assert _rel_rows(out, ref) < 2.5e-2
        assert not out[3].any()   # length 0: zero rows
    assert not ws._counters.any()   # every merging CTA reset its pair's counter


@gpu_only
def test_balanced_schedule_graph_replay_follows_new_lengths():
    """Captured once, replayed with other lengths (so another partition of the run and other
    merges), the balanced schedule equals eager on the same lengths; a length past the block
    table gives NaN rows there only."""
    lens = [3000, 7, 500, 64]
    ld, batch, cache = _case(128, 8, 16, lens)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(4, 32, 128, "cuda")
    out = torch.empty_like(q)
    run = lambda: decode(q, cache, batch.block_table, batch.seq_lens, ld, ws, out=out,
                         kernel="cuda", schedule="balanced")
    g = _capture(run)
    _replays_follow_lengths(g, run, batch, out,
                            ([3000, 7, 500, 64], [100, 2900, 1, 500], [1, 1, 1, 3000]))
    batch.seq_lens[1] = 10**6
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()
    assert not ws._counters.any()
