# session 28, one H100 80GB HBM3 hold, tree 7921699 (compress_store rotation="wht" opt-in; it became the default after these numbers)
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
# call 1 (its pytest line failed to start: pytest-benchmark + xdist INTERNALERROR without -p no:benchmark)
timeout 270 python3 benchmarks/kernels_gpu.py --store-sweep --quick --vllm-only --out $OUT --tag s28_store   # -> kernels_gpu_2026-12-05_s28_store.{md,jsonl}
# call 2
timeout 280 python3 -m pytest packages/tkv-kernels/tests -q -n 8 -p no:benchmark -p no:cacheprovider -k "store or wht or sink or nan or past_the_block or below_the_chunk or pm1 or import_time or empty_batch"   # -> kernels_gpu_tests_2026-12-05_s28.txt
timeout 290 python3 benchmarks/kernels_gpu.py --model-step --quick --vllm-only --out $OUT --tag s28_model   # -> kernels_gpu_2026-12-05_s28_model_step.{md,jsonl}
