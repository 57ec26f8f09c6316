#!/usr/bin/env bash
# tkv-vllm on the lent GPU machine, after ../shared/gpu staging ("TKV READY").
#
# Runs from the repository root on the device (the `run` tool's cwd). Every call is a fresh
# shell, so every mode sets the environment up again (idempotent, about 1 s):
#   * source /tmp/tkv-bin/env.sh (vLLM 0.20.1 in /tmp/tkv-site, SmolLM2 in $TKV_MODEL);
#   * PYTHONPATH += packages/tkv-{codec,kernels,vllm}/src (tkv is a namespace package) and
#     $TKV_EP_DIR, which holds a minimal tkv_vllm-*.dist-info whose entry_points.txt makes
#     the `vllm.general_plugins` entry point `tkv = tkv.vllm.plugin:register` visible to
#     importlib.metadata in every process vLLM starts (no pip, no hatchling needed);
#   * NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...), also in the engines' children.
#
# Modes:
#   go [E2E_ARGS...]     setup + smoke, then `start` (only if the smoke passed) + first poll
#   setup                patch vLLM (`python -m tkv.vllm.cli patch apply`), check the plugin
#   smoke [ARGS...]      vllm_e2e.py smoke: SmolLM2 eager, greedy text bf16 vs tkv@8 / tkv@4
#   start [E2E_ARGS...]  vllm_e2e.py E2E_ARGS in the background (setsid nohup) as job $TKV_JOB
#                        (default e2e) under $TKV_E2E_DIR/jobs/, on $CUDA_VISIBLE_DEVICES.
#                        No args: `all` for SmolLM2 on GPU 0 and for qwen3-8b-like on GPU 1
#                        (two jobs) when there are 2 GPUs, else one job with both models
#   tp [ARGS...]         job "tp": vllm_e2e.py tp --model qwen3-8b-like smollm2-x2 --tp 2 ARGS
#                        (needs both GPUs: refuses while another job runs). The Qwen3-8B-like
#                        model is ONE seeded random checkpoint (16.4 GB bf16, written once to
#                        /tmp/tkv-models/qwen3-8b-like-seed0 on GPU 0, timing in the job log)
#                        loaded at TP=1 and TP=2; `--weights dummy` for the old behaviour.
#                        smollm2-x2 = SmolLM2-135M with every head twice (18 q / 6 KV heads,
#                        same function: vllm_e2e.widen_heads), real weights at TP=2
#   kernels [ARGS...]    job "kernels": benchmarks/gpu_kernels.sh (GPU kernel tests, narrowed by
#                        $TKV_KERNEL_TESTS (pytest -k) if set, then
#                        kernels_gpu.py --step ...) on $CUDA_VISIBLE_DEVICES; needs no staging
#                        (the image's torch / Triton / pytest): start it with the first part
#   (start / tp / kernels with TKV_AFTER=JOB wait in the background for job JOB to end first)
#   poll                 jobs' state + log tails; copies <= 5 flat files into $OUT (e2e.tar.gz also holds
#                        the SGLang session's job under sglang/ when $TKV_SGLANG_E2E, default
#                        /tmp/e2e-sglang, has one: its finished runs survive an early give-back)
#   wait [SECONDS]       keep the machine busy (it is given back after ~30 s idle, and /tmp
#                        with it) until every job ends or SECONDS (default 540) pass, then poll
#   stop                 kill every job's process group and its current engine
#   stop-job NAME        kill one job's process group, wait until it is gone (e.g. to re-start
#                        it on another GPU)
#
# Exit status: non-zero on any failure, with the log tail printed.
set -Eeuo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
E2E=${TKV_E2E_DIR:-/tmp/e2e}
EP=${TKV_EP_DIR:-/tmp/tkv-ep}
ENV_SH=${TKV_ENV_SH:-/tmp/tkv-bin/env.sh}
PY=${PYTHON:-python3}
JOB=$E2E/job
mkdir -p "$E2E"

die() { echo "GPU_SESSION FAILED: $*" >&2; exit 1; }
trap 'echo "GPU_SESSION FAILED: line $LINENO: $BASH_COMMAND (rc=$?)" >&2' ERR

tail_log() {  # tail_log FILE [LINES]
    if [[ -f $1 ]]; then echo "----- tail of $1"; tail -n "${2:-60}" "$1"; echo "-----"; fi
}

env_setup() {
    if [[ -f $ENV_SH ]]; then
        # shellcheck disable=SC1090
        source "$ENV_SH"
    elif [[ $mode =~ ^(kernels|poll|wait|stop|stop-job)$ ]]; then
        # The kernel job needs only the image's torch / Triton / pytest: it can start on a
        # bare machine and run while the rest is staged, and be polled or stopped meanwhile.
        # (../shared/gpu's unpack copies env.sh with every part, so after the first part it
        # exists and is sourced: its PYTHONPATH then names /tmp/tkv-site before the last part
        # installs vLLM there — kernels_gpu.py's optional vLLM rows see vLLM only if they
        # start after that.)
        echo "gpu_session: $ENV_SH missing: '$mode' with the image's Python only" >&2
    else
        die "$ENV_SH missing: stage first (../shared/gpu: unpack every part until TKV READY)"
    fi
    local src="$REPO/packages/tkv-codec/src:$REPO/packages/tkv-kernels/src:$REPO/packages/tkv-vllm/src"
    case ":${PYTHONPATH:-}:" in *":$EP:"*) ;; *) export PYTHONPATH="$src:$EP:${PYTHONPATH:-}" ;; esac
    local ver
    ver=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$REPO/packages/tkv-vllm/pyproject.toml" | head -1)
    local di="$EP/tkv_vllm-${ver:-0.0.1}.dist-info"
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: tkv-vllm\nVersion: %s\n' "${ver:-0.0.1}" > "$di/METADATA"
    printf '[vllm.general_plugins]\ntkv = tkv.vllm.plugin:register\n\n[console_scripts]\ntkv-vllm = tkv.vllm.cli:main\n' \
        > "$di/entry_points.txt"
    # Keep NVLink multicast off everywhere (device rule), also in vLLM's worker processes.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export PYTHONUNBUFFERED=1
    export TKV_MODEL=${TKV_MODEL:-/tmp/tkv-models/smollm2-135m}
    cd "$REPO"
}

do_setup() {
    local log=$E2E/setup.log rc=0
    # The steps run in a child bash with its own `set -e`: in a `{ ...; } > log || die` group
    # (the old form) bash ignores errexit for every command inside, because the group's
    # status is tested by `||`, so a failed check fell through to "SETUP OK". The `||` below
    # only guards the parent; the child process keeps -e and stops at the first failure.
    PY="$PY" REPO="$REPO" bash -euo pipefail -c "$(declare -f setup_steps); setup_steps" \
        > "$log" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]] || ! grep -qx "SETUP OK" "$log"; then
        cat "$log"; die "setup rc=$rc (log: $log)"
    fi
    cat "$log"
}

setup_steps() {  # runs in its own `bash -e`: the first failing step ends it non-zero
        echo "== $(date -u +%FT%TZ) setup in $REPO"
        nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv || true
        "$PY" - <<'EOF'
import importlib.util, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "gpus", torch.cuda.device_count())
import os
assert torch.cuda.is_available() or os.environ.get("TKV_SESSION_CPU_CHECK"), "no CUDA device visible"
for m in ("tkv.codec", "tkv.kernels", "tkv.vllm", "vllm"):
    s = importlib.util.find_spec(m)
    assert s is not None, f"{m} not importable (PYTHONPATH?)"
    print(f"{m:12s} {list(s.submodule_search_locations or [s.origin])[0]}")
EOF
        echo "== tkv-vllm patch apply"
        "$PY" -m tkv.vllm.cli patch apply
        "$PY" -m tkv.vllm.cli patch status
        echo "== plugin discovery and registration"
        "$PY" - <<'EOF'
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tkv"]
assert eps and eps[0].value == "tkv.vllm.plugin:register", f"tkv entry point not found: {eps}"
import vllm
assert vllm.__version__ == "0.20.1", vllm.__version__
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config.cache import get_valid_cache_dtypes
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
assert "tkv" in get_valid_cache_dtypes(), get_valid_cache_dtypes()
cls = E.TURBO_ATTN.get_class()
import tkv.kernels, tkv.vllm.backend  # noqa: F401  (Triton kernels and backend import)
print("vllm", vllm.__version__, "| dtype tkv registered | TURBO_ATTN ->", cls.__module__, cls.__name__)
EOF
        echo "SETUP OK"
}

do_smoke() {
    local log=$E2E/smoke.log
    echo "== smoke: $PY benchmarks/vllm_e2e.py smoke --model $TKV_MODEL --out $E2E/smoke $*"
    set +e
    "$PY" benchmarks/vllm_e2e.py smoke --model "$TKV_MODEL" --out "$E2E/smoke" \
        --gmu 0.5 --max-model-len 2048 --timeout 400 "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    set -e
    if [[ $rc -ne 0 ]]; then
        for f in "$E2E"/smoke/*.log; do [[ -f $f ]] && tail_log "$f" 80; done
        die "smoke rc=$rc (log: $log)"
    fi
}

JOBS=$E2E/jobs
job_running() { [[ -f $1/pid ]] && kill -0 "$(cat "$1/pid")" 2>/dev/null; }
any_running() {  # this script's jobs, and the SGLang session's job if one runs
    local d
    for d in "$JOBS"/*/; do job_running "${d%/}" && return 0; done
    job_running "${TKV_SGLANG_E2E:-/tmp/e2e-sglang}/job"
}
job_state() {
    local d=$1
    if job_running "$d"; then echo "RUNNING for $(( $(date -u +%s) - $(cat "$d/started") ))s"
    else echo "EXITED rc=$(cat "$d/rc" 2>/dev/null || echo '?')"; fi
}

do_start() {  # TKV_JOB names the job (default e2e); CUDA_VISIBLE_DEVICES is passed through
    local name=${TKV_JOB:-e2e}
    local job=$JOBS/$name
    job_running "$job" && die "job $name is already running (pid $(cat "$job/pid")); poll or stop it"
    local args=("$@")
    [[ ${#args[@]} -gt 0 ]] || args=(all --model smollm2 qwen3-8b-like)
    [[ ${args[0]} == serve-check ]] || args+=(--out "$job/results")
    rm -rf "$job"; mkdir -p "$job/results"
    # the visible GPUs only when set: copied from cmd, "CUDA_VISIBLE_DEVICES= ..." would hide all
    { [[ -z ${CUDA_VISIBLE_DEVICES+x} ]] || printf 'CUDA_VISIBLE_DEVICES=%s ' "$CUDA_VISIBLE_DEVICES"
      env | grep -E '^TKV_(LOOKUP|PRMTI_MAXNREG)=' | tr '\n' ' ' || true   # tuning knobs set
      printf '%q ' "$PY" benchmarks/vllm_e2e.py "${args[@]}"; echo; } > "$job/cmd"
    launch "$job" "$PY" benchmarks/vllm_e2e.py "${args[@]}"
}

launch() {  # launch JOB_DIR CMD...: CMD in its own session, after $TKV_AFTER (if set) ends
    # TKV_AFTER: space-separated job names (of this script) or pid files (e.g. the SGLang
    # session's /tmp/e2e-sglang/job/pid); the job starts once none of them is alive.
    local job=$1; shift
    local after="" a
    for a in ${TKV_AFTER:-}; do
        if [[ $a == */* ]]; then after+=" $a"; else after+=" $JOBS/$a/pid"; fi
    done
    # Own session: `stop` kills the group; the driver's engines run in their own groups
    # (vllm_e2e.py kills those itself and records the live one in current_worker.pgid).
    setsid nohup bash -c 'for p in $1; do while [[ -f $p ]] && kill -0 "$(cat "$p")" 2>/dev/null; do sleep 5; done; done
        shift; "$@"; echo $? > "'"$job"'/rc"' _ "$after" "$@" \
        > "$job/job.log" 2>&1 < /dev/null &
    echo $! > "$job/pid"
    date -u +%s > "$job/started"
    sleep 3
    if ! job_running "$job" && [[ "$(cat "$job/rc" 2>/dev/null || echo 1)" != 0 ]]; then
        tail_log "$job/job.log" 80; die "job $(basename "$job") exited at once"
    fi
    echo "started job $(basename "$job") (pid $(cat "$job/pid"))${TKV_AFTER:+ after job $TKV_AFTER}: $(cat "$job/cmd")"
}

do_kernels() {  # job "kernels": GPU kernel tests + kernels_gpu.py (--step, vLLM TurboQuant row)
    local job=$JOBS/kernels
    job_running "$job" && die "job kernels is already running"
    rm -rf "$job"; mkdir -p "$job/results"
    echo "${CUDA_VISIBLE_DEVICES+CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES }${TKV_KERNEL_TESTS+TKV_KERNEL_TESTS='$TKV_KERNEL_TESTS' }bash benchmarks/gpu_kernels.sh $job/results $*" > "$job/cmd"
    launch "$job" bash benchmarks/gpu_kernels.sh "$job/results" "$@"
}

do_start_default() {  # both GPUs busy when there are two: one model per GPU
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ ${n:-1} -ge 2 ]]; then
        TKV_JOB=smollm2 CUDA_VISIBLE_DEVICES=0 do_start all --model smollm2
        TKV_JOB=qwen3 CUDA_VISIBLE_DEVICES=1 do_start all --model qwen3-8b-like
    else
        do_start all --model smollm2 qwen3-8b-like
    fi
}

report_job() {  # report_job JOB_DIR NAME OUT: state, cmd, log tail; README into OUT; 1 if failed
    local d=$1 name=$2 out=$3 state
    state=$(job_state "$d")
    echo "== job $name ($d): $state"
    if [[ -f $d/cmd ]]; then echo "   cmd: $(cat "$d/cmd")"; fi
    if [[ -f $d/job.log ]]; then tail -n 25 "$d/job.log" | sed 's/^/   | /'; fi
    if [[ -f $d/results/README.md ]]; then
        { echo "<!-- job $name -->"; cat "$d/results/README.md"; echo; } >> "$out/README.md"
    fi
    [[ $state == "EXITED rc=0" || $state == RUNNING* ]]
}

do_poll() {
    local out=${OUT:-$E2E/out} d failed=""
    mkdir -p "$out"
    : > "$out/README.md"
    {
        nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader || true
        for d in "$JOBS"/*/; do
            d=${d%/}; [[ -f $d/pid ]] || continue
            report_job "$d" "$(basename "$d")" "$out" || failed+=" $(basename "$d")"
        done
        d=${TKV_SGLANG_E2E:-/tmp/e2e-sglang}/job   # the SGLang session's job, if any
        if [[ -f $d/pid ]]; then report_job "$d" sglang "$out" || failed+=" sglang"; fi
    } > "$out/status.txt" 2>&1
    cat "$out/status.txt"
    # At most 5 flat files (status.txt, README.md, setup.log, smoke.log, e2e.tar.gz), <16 MiB each.
    local cap=$((15 * 1024 * 1024))
    [[ -s $out/README.md ]] || rm -f "$out/README.md"
    if [[ -f $E2E/setup.log ]]; then tail -c "$cap" "$E2E/setup.log" > "$out/setup.log"; fi
    if [[ -f $E2E/smoke.log ]]; then tail -c "$cap" "$E2E/smoke.log" > "$out/smoke.log"; fi
    local tars=() sgl=${TKV_SGLANG_E2E:-/tmp/e2e-sglang}
    [[ -d $JOBS ]] && tars+=("$E2E:jobs")
    [[ -d $E2E/smoke ]] && tars+=("$E2E:smoke")
    # the SGLang session's job too (packages/tkv-sglang/gpu/session), as far as it got: its
    # finished runs come back with every poll, even if the machine goes back before its own poll
    [[ -d $sgl/job ]] && tars+=("$sgl:job")
    if [[ ${#tars[@]} -gt 0 ]]; then
        # results, bundles' json and every log (logs cut to their last 2 MiB), no model dirs
        local stage=$E2E/.pack t root d dest; rm -rf "$stage"; mkdir -p "$stage"
        for t in "${tars[@]}"; do
            root=${t%%:*}; d=${t#*:}
            dest=$stage; [[ $root == "$sgl" ]] && dest=$stage/sglang && mkdir -p "$dest"
            (cd "$root" && find "$d" -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.txt' -o -name cmd -o -name rc \) \
                -not -path '*/models/*' -print0 | xargs -0 -r cp --parents -t "$dest")
            while IFS= read -r -d '' f; do
                mkdir -p "$dest/$(dirname "${f#"$root"/}")"
                tail -c 2097152 "$f" > "$dest/${f#"$root"/}"
            done < <(find "$root/$d" -type f -name '*.log' -not -path '*/models/*' -print0)
        done
        tar -C "$stage" -czf "$out/e2e.tar.gz" .
        if [[ $(stat -c %s "$out/e2e.tar.gz") -gt $cap ]]; then
            tar -C "$stage" -czf "$out/e2e.tar.gz" --exclude='*.log' .
        fi
    fi
    ls -la "$out"
    if [[ -n $failed ]]; then die "job(s) failed:$failed (logs in e2e.tar.gz)"; fi
}

do_wait() {
    local limit=${1:-540} t0 last=""
    t0=$(date -u +%s)
    while any_running && (( $(date -u +%s) - t0 < limit )); do
        local cur
        cur=$(grep -hE '^== |FAILED|done in|^\| |^#### ' "$JOBS"/*/job.log \
              "${TKV_SGLANG_E2E:-/tmp/e2e-sglang}/job/job.log" 2>/dev/null | tail -n 2 || true)
        [[ $cur != "$last" ]] && { echo "[$(( $(date -u +%s) - t0 ))s] $cur"; last=$cur; }
        sleep 10
    done
    do_poll
}

do_stop_job() {  # stop-job NAME: end one job (its process group) and wait until it is gone
    local job=$JOBS/${1:?usage: stop-job NAME} i
    [[ -f $job/pid ]] || die "no job $1"
    kill -TERM -- "-$(cat "$job/pid")" 2>/dev/null || true
    for i in $(seq 20); do job_running "$job" || break; sleep 0.5; done
    if job_running "$job"; then kill -KILL -- "-$(cat "$job/pid")" 2>/dev/null || true; sleep 1; fi
    job_running "$job" && die "job $1 still running"
    echo "job $1 stopped"
}

do_stop() {
    local f
    for f in "$JOBS"/*/pid "$JOBS"/*/results/current_worker.pgid; do
        [[ -f $f ]] || continue
        if kill -TERM -- "-$(cat "$f")" 2>/dev/null; then echo "sent TERM to process group $(cat "$f")"; fi
    done
    sleep 5
    for f in "$JOBS"/*/pid "$JOBS"/*/results/current_worker.pgid; do
        [[ -f $f ]] || continue
        kill -KILL -- "-$(cat "$f")" 2>/dev/null || true
    done
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader || true
}

mode=${1:-}
[[ $# -gt 0 ]] && shift
env_setup
case $mode in
    setup) do_setup ;;
    smoke) do_smoke "$@" ;;
    start) if [[ $# -gt 0 ]]; then do_start "$@"; else do_start_default; fi ;;
    tp) [[ -z ${TKV_AFTER:-} ]] && any_running \
            && die "TP=2 needs both GPUs: wait for / stop the running jobs first (or TKV_AFTER)"
        TKV_JOB=tp do_start tp --model qwen3-8b-like smollm2-x2 --tp 2 "$@" ;;
    kernels) do_kernels "$@" ;;
    poll) do_poll ;;
    wait) do_wait "$@" ;;
    stop) do_stop ;;
    stop-job) do_stop_job "$@" ;;
    go) do_setup; do_smoke
        if [[ $# -gt 0 ]]; then do_start "$@"; else do_start_default; fi
        sleep 10; do_poll ;;
    *) sed -n '2,30p' "${BASH_SOURCE[0]}"; die "unknown mode '${mode}'" ;;
esac
