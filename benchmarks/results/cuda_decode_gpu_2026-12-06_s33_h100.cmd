# Session 33, one NVIDIA H100 80GB HBM3 (device tool), repository root, no staging:
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src

# cuda_decode_gpu_2026-12-06_s33_h100.{md,jsonl} (the full grid + 36-layer model step; tree a693c18)
python3 benchmarks/cuda_decode_gpu.py --model-step --out $OUT --tag 2026-12-06_s33_h100
# cuda_decode_gpu_2026-12-06_s33_h100_quick.{md,jsonl} (tuning variants; tree a693c18 before the
# sub=2 stages=6 / min_ctas=3 variants were replaced; run as --tag s33_v2)
python3 benchmarks/cuda_decode_gpu.py --quick --model-step --out $OUT --tag s33_v2
# cuda_decode_gpu_2026-12-06_s33_h100_v3.{md,jsonl} (the reverted v3 trial,
# cuda_decode_2026-12-06_s33_v3_trial.diff applied)
python3 benchmarks/cuda_decode_gpu.py --quick --model-step --out $OUT --tag 2026-12-06_s33_h100_v3
# cuda_decode_gpu_2026-12-06_s33_h100_sink.{md,jsonl} and cuda_decode_gpu_tests_..._sink.txt (tree ba6a206)
python3 -m pytest packages/tkv-kernels/tests/test_cuda_decode.py packages/tkv-kernels/tests/test_sink_offsets.py -q -n 4 -p no:cacheprovider -p no:benchmark
python3 benchmarks/cuda_decode_gpu.py --sink --out $OUT --tag 2026-12-06_s33_h100_sink
# kernels_gpu_tests_2026-12-06_s33_h100.txt (tree a87134a's code)
python3 -m pytest packages/tkv-kernels/tests -q -n 8 -p no:benchmark -p no:cacheprovider
# ncu_decode_cuda_2026-12-06_s33_h100.txt
ncu --clock-control none --kernel-name regex:tkv_decode_k4v4 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 benchmarks/ncu_decode.py --kernel cuda
# vllm_e2e_2026-12-06_s33_h100_cuda_decode/: see its README.md (../shared/gpu staging, gpu_session.sh)
