"""tkv.vllm — vLLM v0.20.1 adapter for the tkv compressed KV cache.

Install next to ``vllm==0.20.1``, patch once, serve with two flags::

    pip install tkv-vllm vllm==0.20.1
    tkv-vllm patch apply
    TKV_CALIBRATION_FILE=bundle.json TKV_BITS=4.0 \\
        vllm serve MODEL --kv-cache-dtype tkv --attention-backend turbo-attn

Modules: :mod:`~tkv.vllm.plugin` (``vllm.general_plugins`` entry point),
:mod:`~tkv.vllm.patching` / :mod:`~tkv.vllm.cli` (the patch series and ``tkv-vllm patch``),
:mod:`~tkv.vllm.startup` (config validation), :mod:`~tkv.vllm.pages` (page plan),
:mod:`~tkv.vllm.spec` (KV-cache specs; TP head sharding is :mod:`tkv.codec.sharding`),
:mod:`~tkv.vllm.backend` (the attention backend), :mod:`~tkv.vllm.workspace`.
Modules that import vLLM (spec, backend) are not imported here, so ``import tkv.vllm``
works without vLLM installed.
"""

__version__ = "0.0.1"
