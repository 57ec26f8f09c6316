TKV_KERNEL_TESTS="varlen or by_runs or rotate or nan" bash benchmarks/gpu_session.sh kernels --prefix-hits   # tree 307f282, H100 80GB HBM3
