# Session 30, one NVIDIA H100 80GB HBM3 (device tool, no staging; the image's torch 2.11.0+cu130 /
# triton 3.6.0), tree at 0f3cf71 (wht_rows with word stores). The table writer crashed at the end
# (a check row without "impl"), so the .jsonl is the run's stdout rows and the .md was rendered
# from it on the CPU with kernels_gpu.table().
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
timeout 90 python3 -m pytest packages/tkv-kernels/tests -q -n 8 -p no:benchmark -p no:cacheprovider \
    -k "prmts or wht_rows" > $OUT/kernels_gpu_tests_s30.txt 2>&1
PYTHONUNBUFFERED=1 timeout 170 python3 benchmarks/kernels_gpu.py --model-step \
    --model-step-arms "prmti (default),prmts,one token per thread" --store-rows --quick --vllm-only \
    --lookups prmti,prmts --out $OUT --tag s30 > $OUT/bench_log.txt 2>&1
