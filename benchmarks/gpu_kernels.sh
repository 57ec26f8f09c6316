#!/usr/bin/env bash
# gpu_kernels.sh OUT_DIR [KERNELS_GPU_ARGS...] -- on the lent GPU (one device visible):
# tkv-kernels' pytest suite on CUDA (GPU-only cases included), then benchmarks/kernels_gpu.py
# (default: --quick --model-step --step --prefill --vllm-only --lookups prmt,prmti: engine-like
# 36-layer decode steps per configuration, the per-layer decode step at the e2e shapes with its
# per-kernel breakdown, decode at the main shapes against
# cuDNN / bf16 paged / vLLM 0.20.1's TurboQuant when vLLM imports, prefill over a compressed
# prefix inline vs decompress-once). $TKV_KERNEL_TESTS, if set, is a pytest -k expression that
# narrows the tests (a short hold: e.g. "varlen or prefill or rotate"). Runs from the repository root with tkv's
# src folders on PYTHONPATH (benchmarks/gpu_session.sh `kernels` sets them up).
set -uo pipefail
out=${1:?usage: gpu_kernels.sh OUT_DIR [KERNELS_GPU_ARGS...]}
shift
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--quick --model-step --step --prefill --vllm-only --lookups prmt,prmti)
# Run from a snapshot of the tree: the device tool re-copies the working tree into the repo
# root on every call, and the staging calls that follow the one starting this job did so
# while pytest-xdist's workers were importing the test modules (session 24: one worker failed
# to import six of them, "Different tests were collected", no test ran).
out=$(mkdir -p "$out" && cd "$out" && pwd)
snap=$(mktemp -d /tmp/tkv-kernels-tree.XXXXXX)
tar -C "$(dirname "${BASH_SOURCE[0]}")/.." --exclude=./.gpu-stage --exclude=./.gpu-stage-sglang \
    --exclude=./.git -cf - . | tar -C "$snap" -xf -
cd "$snap"
export PYTHONPATH="$snap/packages/tkv-codec/src:$snap/packages/tkv-kernels/src${PYTHONPATH:+:$PYTHONPATH}"
echo "== $(date -u +%FT%TZ) kernel tests on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
sel=()
[[ -z ${TKV_KERNEL_TESTS:-} ]] || sel=(-k "$TKV_KERNEL_TESTS")
timeout 420 python3 -m pytest packages/tkv-kernels/tests -q -n 8 -p no:benchmark \
    -p no:cacheprovider "${sel[@]}" > "$out/kernels_gpu_tests.txt" 2>&1
rc_tests=$?
tail -n 3 "$out/kernels_gpu_tests.txt"
echo "== $(date -u +%FT%TZ) kernels_gpu.py ${args[*]}"
timeout 420 python3 benchmarks/kernels_gpu.py "${args[@]}" --out "$out" --tag gpu \
    > "$out/kernels_gpu.log" 2>&1
rc_bench=$?
tail -n 5 "$out/kernels_gpu.log"
echo "tests rc=$rc_tests bench rc=$rc_bench"
[[ $rc_tests -eq 0 && $rc_bench -eq 0 ]]
