"""Tensor-parallel KV-head sharding (tkv.codec.sharding, the engines' QKVParallelLinear rule)
and a TP rank's codec (TkvConfig.codec's ``shard``): per-head offsets sliced to the rank."""

from __future__ import annotations

import pytest
import torch

from tkv.codec import (
    BitWidthError,
    CalibrationBundle,
    KvHeadShard,
    LayerAllocation,
    LayerCalibration,
    ModelGeometry,
    ShapeError,
    SlotLayout,
    load_config,
    shard_kv_heads,
)


@pytest.mark.parametrize(("h", "t"), [(8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (1, 8), (4, 8)])
def test_kv_head_shards_cover_the_heads(h, t):
    shards = [shard_kv_heads(h, t, r) for r in range(t)]
    covered = sorted({x for s in shards for x in s.heads})
    assert covered == list(range(h))
    assert all(s.num_local_heads == max(1, h // t) for s in shards)
    assert all(s.replicas == max(1, t // h) for s in shards)
    # contiguous blocks in rank order; replicas of one head on consecutive ranks
    assert [s.first_head for s in shards] == [r * h // t if h >= t else r // (t // h)
                                              for r in range(t)]
    # per-rank pages add up to the whole model's page when heads are split
    if h >= t:
        whole = SlotLayout(128, h, 4, 3, 16).page_bytes
        assert sum(SlotLayout(128, s.num_local_heads, 4, 3, 16).page_bytes
                   for s in shards) == whole


@pytest.mark.parametrize(("h", "t", "r"), [(6, 4, 0), (3, 2, 0), (8, 2, 2), (0, 1, 0), (2, 2, -1)])
def test_bad_sharding_is_refused(h, t, r):
    with pytest.raises(ShapeError):
        shard_kv_heads(h, t, r)


def test_config_codec_slices_per_head_offsets_to_the_rank(tmp_path):
    """TkvConfig.codec(layer, shard=...): a rank's codec carries the rows of its heads for the
    per-head key offset and sink offsets (replicated heads included) and codes its heads
    exactly as the whole-model codec codes them; shared offsets are untouched; an empty shard
    or one beyond the model's heads is refused by name."""
    h, d = 4, 64
    g = torch.Generator().manual_seed(1)
    mu, sk, sv, shared = (torch.randn(h, d, generator=g) for _ in range(4))
    flat = lambda t: tuple(t.flatten().tolist())
    scales = flat(torch.rand(d, generator=g) + 0.5)
    layers = (LayerCalibration(scales, None, {}, flat(shared[0])),
              LayerCalibration(scales, None, {}, flat(mu), flat(sk), flat(sv)),
              LayerCalibration())
    b = CalibrationBundle(ModelGeometry(3, h, d, model="tiny"), layers,
                          {"4.0": LayerAllocation.uniform(3, 4, 4)}, {"tool": "test"})
    path = b.save(tmp_path / "ph.json")
    cfg = load_config(3, h, d, {"TKV_CALIBRATION_FILE": str(path)})
    full = cfg.codec(1)
    x = torch.randn(6, h, d, generator=g) * 2 + mu
    pk, nk = full.compress_k(x)
    pv, nv = full.compress_v(x)
    for t in (1, 2, 4, 8):
        for r in range(t):
            s = shard_kv_heads(h, t, r)
            idx = list(s.heads)
            c = cfg.codec(1, shard=s)
            assert torch.equal(c.k.channel_offset, mu[idx])
            assert torch.equal(c.k.sink_offset, sk[idx]) and torch.equal(c.v.sink_offset, sv[idx])
            rk, rnk = c.compress_k(x[:, idx])
            rv, rnv = c.compress_v(x[:, idx])
            assert torch.equal(rk, pk[:, idx]) and torch.equal(rnk, nk[:, idx])
            assert torch.equal(rv, pv[:, idx]) and torch.equal(rnv, nv[:, idx])
            # layer 0's shared (head_dim,) μ is the same on every rank
            assert torch.equal(cfg.codec(0, shard=s).k.channel_offset, shared[0])
    for bad in (KvHeadShard(2, 3, 1), KvHeadShard(0, 0, 1), KvHeadShard(1, -1, 1)):
        with pytest.raises(ShapeError, match="inside the model"):
            cfg.codec(1, shard=bad)
    # served wider than the row (an engine's common pages): same offsets, the given widths
    wide = cfg.codec(1, shard=shard_kv_heads(h, 2, 0), bits=(6, 5))
    assert (wide.k.bits, wide.v.bits, cfg.codec(1).k.bits) == (6, 5, 4)
    assert torch.equal(wide.k.channel_offset, mu[:2])
    with pytest.raises(BitWidthError):
        cfg.codec(1, bits=(9, 4))
    # without a bundle the shard only checks the heads
    with pytest.warns(UserWarning):
        plain = load_config(3, h, d, {})
    assert plain.codec(1, shard=shard_kv_heads(h, 2, 1)).k.channel_offset is None
    with pytest.raises(ShapeError, match="inside the model"):
        plain.codec(1, shard=KvHeadShard(1, h, 1))


@pytest.mark.parametrize("args", [("8", 2, 1), (None, 2, 0), (8.0, 2, 1), (8, 2.0, 0),
                                  (8, 2, True)])
def test_shard_kv_heads_refuses_non_int_sizes(args):
    """A float 8.0 used to come back as a KvHeadShard holding floats; None / "8" were
    TypeErrors from a comparison."""
    with pytest.raises(ShapeError, match="must be an int"):
        shard_kv_heads(*args)
