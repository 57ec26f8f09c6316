"""The GPU end-to-end script's host-side parts (bundle, agreement, table) on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tkv.codec.config import load_config

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_e2e.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("vllm_e2e", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_uniform_bundle_serves_bits_4_and_8(e2e, tmp_path):
    model = e2e.make_qwen3_like(tmp_path)
    bundle = e2e.write_uniform_bundle(model, tmp_path / "b.json")
    for bits, w in (("8.0", 8), ("4", 4)):
        cfg = load_config(36, 8, 128, env={"TKV_BITS": bits, "TKV_CALIBRATION_FILE": str(bundle)})
        assert set(cfg.allocation.k_bits) == set(cfg.allocation.v_bits) == {w}
    assert json.loads((model / "config.json").read_text())["num_key_value_heads"] == 8


def test_agreement_and_table(e2e):
    a = [[1, 2, 3] * 11, [5] * 32]
    b = [[1, 2, 3] * 11, [5] * 16 + [6] * 16]
    exact, frac = e2e.agreement(a, b)
    assert exact == 1 and frac == pytest.approx((1 + 0.5) / 2)
    tp = {"64": {"output_tok_s": 1000.0}, "256": {"output_tok_s": 2000.0}}
    res = {"bf16": {"kv_tokens_reported": 1000, "greedy": a, "throughput": tp},
           "tq4": {"kv_tokens_blocks": 2620, "greedy": b,
                   "throughput": {k: {"output_tok_s": v["output_tok_s"] / 2} for k, v in tp.items()}},
           "tkv@4.0": {"kv_tokens_reported": 3800, "greedy": b,
                       "throughput": {k: {"output_tok_s": v["output_tok_s"] * 1.1}
                                      for k, v in tp.items()}},
           "tkv@8.0": {"failed": True}}
    t = e2e.table("m", res)
    assert "| tkv@4.0 | 3,800 | 3.80 | 1/2 exact, 75% prefix | 1,100 | 2,200 | 1.10 / 1.10 | 2.20 / 2.20 |" in t
    assert "| tkv@8.0 | FAILED" in t
