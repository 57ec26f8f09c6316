# one H100 80GB HBM3 hold, session 37 (2026-12-06 ~23:15 UTC), tree at commit
# "tkv-sglang tests: the pip lookup ..." (c1c5929: early / teams built, TKV_DECODE_CONTEXT default
# still `short`); about 11 earlier requests this session were refused or failed to start
export PYTHONPATH=$PWD/packages/tkv-codec/src:$PWD/packages/tkv-kernels/src
# call 1 (216 s)
timeout 240 python3 benchmarks/cuda_decode_gpu.py --teams --out $OUT --tag s37_teams
#   -> cuda_decode_gpu_2026-12-06_s37_h100_teams.{md,jsonl}
timeout 150 python3 -m pytest packages/tkv-kernels/tests/test_cuda_decode.py \
    packages/tkv-kernels/tests/test_sink_offsets.py \
    -k "cuda or Cuda or ctas or context or balanced or split_rule or oracle or team" -q -p no:cacheprovider
#   -> cuda_decode_gpu_tests_2026-12-06_s37_h100.txt (101 passed)
# call 2 (18 s): short / long / long + team_steps=128 at more shapes
cd benchmarks; python3 -c "
import cuda_decode_gpu as c, cuda_bench as cb
copy=cb.start()
V=[('default, TKV_DECODE_CONTEXT=short', {}, {'kernel': None, '_context': 'short'}),('default, TKV_DECODE_CONTEXT=long', {}, {'kernel': None, '_context': 'long'}),('long, team_steps=128', {'team_steps': 128}, {'kernel': None, '_context': 'long'})]
S=[(1,32768,32,8,128),(1,131072,32,8,128),(8,8192,32,8,128),(8,32768,32,8,128),(128,32768,32,8,128),(64,8192,32,8,128),(128,1024,32,8,128),(32,8192,32,8,256),(64,(32768,1024),32,8,128)]
c.kernel_rows(S, copy, V)
cb.write_results('$OUT','cuda_decode_gpu','s37_teams_more', c.table(copy))"
#   -> cuda_decode_gpu_2026-12-06_s37_h100_teams_more.{md,jsonl}
#   (the D=256 team_steps row errors by design: teams need 8 warps, the long profile has 4 there)
