# Source on the GPU device after both stagings printed READY (the vLLM set's "TKV READY",
# then this one's "TKV SGLANG READY"):
#     source /tmp/tkv-bin/env-sglang.sh
# Sources the vLLM set's env.sh, then puts the SGLang overlay in front of it. Safe to source
# more than once.
# shellcheck disable=SC1091
source "${TKV_BIN:-/tmp/tkv-bin}/env.sh"
TKV_SITE_SGLANG=${TKV_SITE_SGLANG:-/tmp/tkv-site-sglang}
case ":${PYTHONPATH:-}:" in
  *":$TKV_SITE_SGLANG:"*) ;;
  # first: its transformers 5.6.0 / tokenizers 0.22.2 shadow the image's 5.17.0 / 0.23.2
  *) export PYTHONPATH="$TKV_SITE_SGLANG:$PYTHONPATH" ;;
esac
case ":$PATH:" in *":$TKV_SITE_SGLANG/bin:"*) ;; *) export PATH="$TKV_SITE_SGLANG/bin:$PATH" ;; esac
# sgl_kernel's sm90 ops link libnuma.so.1; use the staged copy only if the image lacks one.
if ! ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1 '; then
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$TKV_SITE_SGLANG/.libs:"*) ;;
    *) export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$TKV_SITE_SGLANG/.libs" ;;
  esac
fi
# flashinfer-python is staged only because srt/layers/sampler.py imports it on CUDA; keep
# sglang off every flashinfer path (no JIT, no cubins on the device).
export SGLANG_IS_FLASHINFER_AVAILABLE=false
# offline, no telemetry; NVLink multicast off (device rule), also in sglang's children
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TKV_MODEL=${TKV_MODEL:-/tmp/tkv-models/smollm2-135m}
