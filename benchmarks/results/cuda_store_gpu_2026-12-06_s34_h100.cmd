# one H100 80GB HBM3 hold, session 34 (2026-12-06 ~15:47 UTC), tree at the commit that adds this file's
# kernel code (cuda/store_wht.cu as of "review: one CUDA-fallback warning helper ...")
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
python3 diag_store.py            # = benchmarks/cuda_store_agreement_gpu.py (committed after the run) -> cuda_store_agreement_gpu_2026-12-06_s34_h100.txt
python3 -m pytest packages/tkv-kernels/tests/test_cuda_store.py -q -p no:cacheprovider
timeout 120 python3 benchmarks/cuda_store_gpu.py --quick --out $OUT --tag s34_v2
# second call: the 36-layer model step
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import cuda_store_gpu as c, cuda_bench as b; b.start(); c.model_step_rows(((64,640),(256,640))); print('\n'.join(b.model_step_lines()))"
# third / fourth call: test_cuda_store.py again after the bitwise-poison fix: 38 passed
