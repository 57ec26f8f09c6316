"""Serving configuration shared by every engine adapter (vLLM, SGLang, ...).

An operator configures tkv with two environment variables, read and validated ONCE at engine
startup by :func:`load_config`:

* ``TKV_BITS`` — average bits per K/V element to spend, a float in [2.0, 8.0] (default 4.0).
* ``TKV_CALIBRATION_FILE`` — path of a calibration bundle (``tkv-calibrate`` writes one).
  Unset: uniform K4V4, Gaussian codebooks, no channel scales, with a loud warning.

Every failure is a named error raised before the engine allocates anything: missing bundle
file (FileNotFoundError), malformed bundle (BundleSchemaError), bundle for another model
(BundleGeometryError), no row for ``TKV_BITS`` (BudgetRowMissingError), bad ``TKV_BITS``
(TkvBitsError). Engine code never parses these variables itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .bundle import CalibrationBundle, LayerAllocation, normalize_tkv_bits, resolve_allocation
from .codec import TurboKVCodec
from .errors import BudgetRowMissingError, ShapeError
from .layout import SlotLayout
from .sharding import KvHeadShard

__all__ = ["ENV_BITS", "ENV_CALIBRATION_FILE", "TkvConfig", "load_config"]

ENV_BITS = "TKV_BITS"
ENV_CALIBRATION_FILE = "TKV_CALIBRATION_FILE"


@dataclass(frozen=True)
class TkvConfig:
    """Validated tkv serving config for one model.

    Attributes:
        tkv_bits: canonical budget key ("4.0").
        allocation: per-layer (k_bits, v_bits).
        bundle: the loaded bundle, or None (uniform K4V4 default).
        num_layers, num_kv_heads, head_dim: the served model's geometry (num_kv_heads is the
            whole model's, before tensor-parallel sharding).
    """

    tkv_bits: str
    allocation: LayerAllocation
    bundle: CalibrationBundle | None
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def layer_bits(self, layer: int) -> tuple[int, int]:
        """``(k_bits, v_bits)`` of attention layer ``layer``.

        Raises:
            IndexError: ``layer`` outside ``0 .. num_layers - 1`` (negative indices included:
                a layer index never counts from the end)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer!r} outside 0..{self.num_layers - 1}")
        return self.allocation.k_bits[layer], self.allocation.v_bits[layer]

    def slot_layout(self, layer: int, block_size: int, num_kv_heads: int | None = None) -> SlotLayout:
        """The :class:`SlotLayout` of ``layer``; ``num_kv_heads`` overrides for a TP rank's shard
        (None: the model's; 0 or less is refused by SlotLayout with ShapeError)."""
        kb, vb = self.layer_bits(layer)
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return SlotLayout(self.head_dim, heads, kb, vb, block_size)

    def codec(self, layer: int, device: torch.device | str = "cpu",
              shard: KvHeadShard | None = None, bits: tuple[int, int] | None = None,
              **kwargs) -> TurboKVCodec:
        """The :class:`TurboKVCodec` of ``layer`` (bundle scales/codebooks if a bundle is set).
        Hot paths should pass ``check_finite=False``.

        ``shard``: the KV heads of this tensor-parallel rank (:func:`tkv.codec.shard_kv_heads`);
        a bundle's per-head offsets (key offset μ, sink offsets; ``(num_kv_heads, head_dim)``)
        are sliced to ``shard.heads``, so the codec's head ``h`` is the model's head
        ``shard.first_head + h``. None: all ``num_kv_heads`` heads.
        ``bits``: ``(k_bits, v_bits)`` to serve the layer at instead of its row's widths (an
        engine that stores a layer wider than allocated, e.g. vLLM's common pages).

        Raises:
            ShapeError: ``shard`` is empty or names heads outside the model's ``num_kv_heads``.
            BitWidthError: ``bits`` outside 2..8.
        """
        kb, vb = self.layer_bits(layer) if bits is None else bits
        if shard is not None and (shard.num_local_heads < 1 or shard.first_head < 0 or
                                  shard.first_head + shard.num_local_heads > self.num_kv_heads):
            raise ShapeError(f"TP shard heads {list(shard.heads)} are not a non-empty range "
                             f"inside the model's {self.num_kv_heads} KV heads")
        if self.bundle is not None:
            heads = None if shard is None else shard.heads
            return self.bundle.codec(layer, kb, vb, device, heads=heads, **kwargs)
        return TurboKVCodec(self.head_dim, k_bits=kb, v_bits=vb, device=device, **kwargs)

    def describe(self) -> str:
        """One line for the engine's startup log."""
        src = "uniform K4V4 default (no bundle)" if self.bundle is None else (
            f"bundle {self.bundle.geometry.model or '?'} row {self.tkv_bits} ({self.allocation.source})")
        return (f"tkv: TKV_BITS={self.tkv_bits}, {src}, "
                f"{self.allocation.bits_per_element(self.head_dim):.3f} bits/element incl. norms")


def load_config(num_layers: int, num_kv_heads: int, head_dim: int,
                env: Mapping[str, str] | None = None) -> TkvConfig:
    """Read ``TKV_BITS`` / ``TKV_CALIBRATION_FILE`` from ``env`` (default ``os.environ``) and
    validate them against the model geometry.

    Raises:
        TkvBitsError, FileNotFoundError (also a directory or a non-regular file),
        PermissionError (an unreadable file, the variable named), BundleSchemaError,
        BundleGeometryError,
        BudgetRowMissingError (see module docstring); ShapeError: a geometry value that is
        not a positive int.
    """
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ShapeError(f"model geometry: {name} must be a positive int, got {v!r}")
    env = os.environ if env is None else env
    raw_bits = (env.get(ENV_BITS) or "").strip()   # unset or blank: the default, like every TKV_*
    key = normalize_tkv_bits(raw_bits or "4.0")
    path = (env.get(ENV_CALIBRATION_FILE) or "").strip()
    bundle = None
    if path:
        p = Path(path).expanduser()
        if p.is_dir():
            raise FileNotFoundError(f"{ENV_CALIBRATION_FILE}={path!r} is a directory; it must "
                                    "name a calibration bundle file (tkv_bundle.json)")
        if not p.exists():
            raise FileNotFoundError(f"{ENV_CALIBRATION_FILE}={path!r}: no such file")
        if not p.is_file():   # /dev/null, a FIFO, a socket
            raise FileNotFoundError(f"{ENV_CALIBRATION_FILE}={path!r} is not a regular file; "
                                    "it must name a calibration bundle file (tkv_bundle.json)")
        try:
            bundle = CalibrationBundle.load(p)
        except PermissionError as e:
            raise PermissionError(f"{ENV_CALIBRATION_FILE}={path!r} cannot be read: "
                                  f"{e.strerror}") from None
    try:
        alloc = resolve_allocation(bundle, key, num_layers, num_kv_heads, head_dim)
    except BudgetRowMissingError as e:
        if raw_bits:
            raise
        raise BudgetRowMissingError(f"{e} ({ENV_BITS} is unset, so it defaulted to 4.0: set "
                                    f"{ENV_BITS} to one of the rows)") from None
    return TkvConfig(key, alloc, bundle, num_layers, num_kv_heads, head_dim)
