# one H100 80GB HBM3 hold, session 36 (2026-12-06 20:31-20:38 UTC), tree at commit
# "README: the test counts after session 36's tests" (balanced schedule, lut / warps tuning)
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
# call 1 (114 s)
timeout 170 python3 -m pytest packages/tkv-kernels/tests/test_cuda_decode.py -q -p no:cacheprovider
#   -> cuda_decode_gpu_tests_2026-12-06_s36_h100.txt (64 passed)
timeout 320 python3 benchmarks/cuda_decode_gpu.py --quick --model-step --out $OUT --tag s36
#   -> cuda_decode_gpu_2026-12-06_s36_h100.{md,jsonl}
# call 2 (27 s): the lut / warps / split grid at more shapes
cd benchmarks; python3 -c "
import cuda_decode_gpu as c, cuda_bench as cb
copy=cb.start()
V=[(\"cuda (decode's default, kernel='auto')\", {}, {'kernel': None}),('cuda 1 split', {}, {'num_splits': 1}),('cuda lut=1, 1 split', {'lut': 1}, {'num_splits': 1}),('cuda lut=1, 2 splits', {'lut': 1}, {'num_splits': 2}),('cuda lut=1 warps=8, 1 split', {'lut': 1, 'warps': 8}, {'num_splits': 1}),('cuda lut=1 warps=8, 2 splits', {'lut': 1, 'warps': 8}, {'num_splits': 2}),('cuda lut=1 warps=8, 4 splits', {'lut': 1, 'warps': 8}, {'num_splits': 4})]
S=[(8,8192,32,8,128),(8,32768,32,8,128),(32,32768,32,8,128),(128,8192,32,8,128),(128,32768,32,8,128),(64,8192,32,8,128),(1,131072,32,8,128),(32,8192,32,8,64),(32,8192,32,8,256)]
c.kernel_rows(S, copy, V)
cb.write_results('$OUT','cuda_decode_gpu','s36_grid', c.table(copy))"
#   -> cuda_decode_gpu_2026-12-06_s36_h100_grid.{md,jsonl}
# call 3 (40 s): 36-layer steps at longer contexts
python3 -c "
import cuda_bench as cb, cuda_decode_gpu as c
from tkv.kernels import cuda_decode
from tkv.kernels.testing import tuning
copy=cb.start()
arms=[('bf16 store + bypass decode','bf16',None),('tkv K4V4 default (kernel=auto: cuda)',{},None),('tkv K4V4 cuda lut=1 warps=8, 1 split',{'num_splits':1},lambda: tuning(cuda_decode, lut=1, warps=8)),('tkv K4V4 cuda lut=1, 1 split',{'num_splits':1},lambda: tuning(cuda_decode, lut=1)),('tkv K4V4 cuda lut=1 warps=8, 2 splits',{'num_splits':2},lambda: tuning(cuda_decode, lut=1, warps=8))]
cb.model_step_rows(((32,8192),(64,2048),(64,640)), arms)
cb.write_results('$OUT','cuda_decode_gpu','s36_step', c.table(copy))"
#   -> cuda_decode_gpu_2026-12-06_s36_h100_step.{md,jsonl}
