# session 32, one H100 80GB HBM3 (device tool, nvidia-h100-x1), tree fbaf2b3's kernels (uncommitted then)
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
python3 -m pytest packages/tkv-kernels/tests/test_gpu.py -q -k "compress_store" -p no:cacheprovider -x   # 11 passed
timeout 330 python3 benchmarks/kernels_gpu.py --store-sweep --quick --vllm-only --lookups prmti --out $OUT --tag s32_store
# the 330 s limit ended the run inside the head_dim-256 rows of the store sweep (before the
# decode rows and the .md table): the rows below are the .jsonl, rendered by kernels_gpu.table
