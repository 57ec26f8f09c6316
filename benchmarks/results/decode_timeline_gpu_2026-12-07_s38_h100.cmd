# session 38 (2026-12-07), one H100 80GB HBM3 hold at ~00:40 UTC after four refused or failed
# device requests; tree at commit 56bb6cb + the probe-row fix of the next commit
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src PYTHONUNBUFFERED=1
# call 1 (257 s): the full kernel GPU suite with TKV_DECODE_CONTEXT=auto as the implicit default
# (the timeline script failed on a float byte count in this call; fixed before call 2)
python3 -m pytest packages/tkv-kernels/tests -q -n 8 -p no:benchmark -p no:cacheprovider
#   -> kernels_gpu_tests_2026-12-07_s38_h100.txt: 639 passed, 1 failed (the new probe test: the
#      in-kernel merge's atomics landed in the probe's rows; fixed, 9/9 probe + merge tests passed
#      in call 2)
# call 2 (40 s)
python3 -m pytest packages/tkv-kernels/tests/test_cuda_decode.py -q -p no:cacheprovider -k "probe or merge"
python3 benchmarks/decode_timeline_gpu.py --out $OUT --tag s38 --contexts auto short
#   -> decode_timeline_gpu_2026-12-07_s38_h100.{md,jsonl}
