"""The backend's forward on CPU under the Triton interpreter (subprocess: the interpreter
must be switched on before any Triton kernel is defined)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("small_head_groups", ["0", None])
def test_mixed_batch_forward_matches_float64_reference(patched_vllm, small_head_groups):
    script = Path(__file__).with_name("forward_check.py")
    # TKV_LOOKUP reaches every layer's loader (gather: exact, as auto is under the interpreter);
    # so does TKV_SMALL_HEAD_GROUPS: unset = the default (on; head_dim 32: the 3-bit side then
    # decodes as 8-code groups), 0 = per element; TKV_FUSED_QUERY_ROTATION likewise: unset =
    # the default (every decode rotates its query inside the split kernel), 0 (with the
    # latter) = the separate rotate_rows launch
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "TKV_LOOKUP": "gather"}
    env.pop("TKV_SMALL_HEAD_GROUPS", None)
    env.pop("TKV_FUSED_QUERY_ROTATION", None)
    if small_head_groups is not None:
        env["TKV_SMALL_HEAD_GROUPS"] = small_head_groups
        env["TKV_FUSED_QUERY_ROTATION"] = "0"
    env.pop("TKV_BITS", None)
    env.pop("TKV_CALIBRATION_FILE", None)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=900)
    report = "\n".join(line for line in r.stdout.splitlines()
                       if "rel err" in line or "worst" in line)
    assert r.returncode == 0, f"{report}\n{r.stderr[-3000:]}"
    # per-layer widths, sliding window, and spec-decode verify rows exercised
    assert "spec_k=2 layer 1 K3V2 window=12 request 0" in report
    # the mixed batch's prefill rows as two runs, the first chunk's through FlashAttention
    assert "flash spec_k=0 layer 1 K3V2 window=12 request 2" in report
    assert "padded decode layer 1 request 1" in report  # CUDA-graph padded decode batch
    assert "first prefill layer 1 request 1" in report   # bypass + prefix-variant warm-up
    assert "long continuation layer 0 window=0" in report   # one exact prefix: SDPA path
    # TKV_PREFILL_ATTENTION=flash (vLLM's FlashAttention faked on CPU): same paths through it
    assert "flash first prefill layer 1 request 1" in report
    assert "flash long continuation layer 0 window=0" in report
    print(report)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
