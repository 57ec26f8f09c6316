bash benchmarks/gpu_session.sh kernels --prefix-hits   # tree 5576ff5, NVIDIA H200 (full GPU kernel suite, then --prefix-hits)
