# one H100 80GB HBM3 hold, session 35 (2026-12-06 ~17:00 UTC); the kernel at the commit
# "kernels: the CUDA decode kernel's shared pair-table lookup (lut=1, opt-in)" (4 warps only)
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
timeout 200 python3 -m pytest packages/tkv-kernels/tests/test_cuda_decode.py -q -p no:cacheprovider -x
#   -> cuda_decode_gpu_tests_2026-12-06_s35_h100_lut.txt (35 passed)
timeout 380 python3 benchmarks/cuda_decode_gpu.py --quick --model-step --out $OUT --tag s35_lut
#   -> cuda_decode_gpu_2026-12-06_s35_h100_lut.{md,jsonl}
# third call of the hold: Nsight Compute at B=32, L=8K (the second tkv launch of ncu_decode.py)
for lut in 0 1; do ncu --clock-control none --kernel-name regex:tkv_decode_k4v4 --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section InstructionStats --section MemoryWorkloadAnalysis \
  python3 benchmarks/ncu_decode.py --kernel cuda --lut $lut > ncu_decode_cuda_2026-12-06_s35_h100_lut$lut.txt; done
