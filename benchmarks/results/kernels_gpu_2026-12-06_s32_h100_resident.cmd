# session 32, one H100 80GB HBM3 (device tool, no staging), tree 0846eb0 (+ the maxnreg-168 prmts
# arm of the repeat, added after the first run)
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
timeout 75 python3 -m pytest packages/tkv-kernels/tests/test_gpu.py -q -k "resident" -p no:cacheprovider   # 4 passed
PYTHONUNBUFFERED=1 timeout 270 python3 benchmarks/kernels_gpu.py --model-step \
    --model-step-arms "prmti (default),prmts (anti,resident" --quick --vllm-only \
    --lookups prmti,prmti+r,prmts,prmts+r --out $OUT --tag s32_resident
# the repeat, one minute later on the same warm machine:
PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/kernels_gpu.py --model-step \
    --model-step-arms "prmti (default),prmts (anti,resident" --vllm-only --quick \
    --lookups prmts+r --out $OUT --tag s32_resident2
