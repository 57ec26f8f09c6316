"""tkv.sglang — SGLang v0.5.11 adapter for the tkv compressed KV cache.

* ``tkv-sglang patch apply|revert|status`` (:mod:`tkv.sglang.cli`, :mod:`tkv.sglang.patching`)
  manages the small patch series that lets plugins add KV-cache dtypes to SGLang.
* The general plugin :func:`tkv.sglang.plugin.register` (entry point ``sglang.srt.plugins``)
  adds ``--kv-cache-dtype tkv`` and ``--attention-backend turbo-attn``.
* Config: ``TKV_BITS`` / ``TKV_CALIBRATION_FILE``, validated once by
  :func:`tkv.codec.config.load_config` (shared with tkv-vllm).

Modules importing sglang (``pool``, ``backend``) are only imported by the plugin.
"""

__version__ = "0.0.1"
