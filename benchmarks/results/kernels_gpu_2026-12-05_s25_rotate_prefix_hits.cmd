# on the device (one H100 80GB), tree f7bf730, 2026-12-05, with staging part 1:
TKV_KERNEL_TESTS="varlen or by_runs" bash benchmarks/gpu_session.sh kernels --rotate --prefix-hits
# = TKV_KERNEL_TESTS='varlen or by_runs' bash benchmarks/gpu_kernels.sh OUT --rotate --prefix-hits
#   (GPU tests -> kernels_gpu_tests_2026-12-05_s25_varlen.txt; rows -> this .md / .jsonl)
