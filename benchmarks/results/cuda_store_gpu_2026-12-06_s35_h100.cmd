# one H100 80GB HBM3 hold, session 35 (2026-12-06 ~17:02 UTC), tree = the commit that adds this file
# minus the TKV_STORE_KERNEL default change (the arms set cuda_store.STORE_KERNEL explicitly)
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
# call 1: three repeats of the 36-layer step, arms bf16 / Triton store / CUDA store
python3 - <<'PY'
import sys, os, json
sys.path.insert(0,'benchmarks')
import cuda_store_gpu as c, cuda_bench as b
b.start()
for rep in range(3):
    c.model_step_rows(((64,640),(256,640)))
PY
#   -> cuda_store_model_step_2026-12-06_s35_h100.{md,jsonl} (first part)
timeout 280 python3 benchmarks/cuda_store_gpu.py --out $OUT --tag s35_h100
#   -> cuda_store_gpu_2026-12-06_s35_h100.{md,jsonl}
# call 2 (same warm machine): two repeats with the arms reversed (CUDA store first)
python3 - <<'PY'
import sys
sys.path.insert(0,'benchmarks')
import cuda_store_gpu as c, cuda_bench as b
b.start()
arms = [("bf16 store + bypass decode", "bf16", None),
        ("tkv K4V4, CUDA store (TKV_STORE_KERNEL=auto)", {}, lambda: c.store_kernel("auto")),
        ("tkv K4V4, Triton store (the default)", {}, lambda: c.store_kernel("triton"))]
for rep in range(2):
    b.model_step_rows(((64,640),(256,640)), arms)
PY
#   -> cuda_store_model_step_2026-12-06_s35_h100.{md,jsonl} (second part)
