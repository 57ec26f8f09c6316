"""tkv.codec — the TurboQuant KV-cache codec in pure PyTorch.

Public API::

    from tkv.codec import TurboKVCodec, SlotLayout, CalibrationBundle
    codec = TurboKVCodec(head_dim=128, bit_width=4, device="cpu")
    packed, norms = codec.compress_k(torch.randn(8, 128))
    recon = codec.decompress_k(packed, norms)

Modules: :mod:`~tkv.codec.codec` (the codec), :mod:`~tkv.codec.rotation` (randomized WHT),
:mod:`~tkv.codec.codebooks` (Lloyd-Max), :mod:`~tkv.codec.packing` (bit order),
:mod:`~tkv.codec.layout` (bytes of the paged cache), :mod:`~tkv.codec.bundle` (calibration
bundle), :mod:`~tkv.codec.config` (``TKV_BITS`` / ``TKV_CALIBRATION_FILE``),
:mod:`~tkv.codec.sharding` (KV heads of a tensor-parallel rank), :mod:`~tkv.codec.errors`
(named exceptions).
"""

from .bundle import (
    CalibrationBundle,
    LayerAllocation,
    LayerCalibration,
    ModelGeometry,
    normalize_tkv_bits,
    resolve_allocation,
)
from .codebooks import Codebook, beta_codebook, fit_codebook, gaussian_codebook
from .codec import SideCodec, TurboKVCodec
from .config import TkvConfig, load_config
from .errors import (
    BitWidthError,
    BudgetRowMissingError,
    BundleError,
    BundleGeometryError,
    BundleSchemaError,
    CodebookError,
    DeviceMismatchError,
    DtypeError,
    NonFiniteError,
    ShapeError,
    TkvBitsError,
    TkvError,
    UnsupportedFeatureError,
)
from .layout import ModelLayout, SlotLayout, effective_bits_per_element
from .packing import pack_codes, unpack_codes
from .rotation import HadamardRotation
from .sharding import KvHeadShard, shard_kv_heads

__version__ = "0.1.0"

__all__ = [
    "BitWidthError",
    "BudgetRowMissingError",
    "BundleError",
    "BundleGeometryError",
    "BundleSchemaError",
    "CalibrationBundle",
    "Codebook",
    "CodebookError",
    "DeviceMismatchError",
    "DtypeError",
    "HadamardRotation",
    "KvHeadShard",
    "LayerAllocation",
    "LayerCalibration",
    "ModelGeometry",
    "ModelLayout",
    "NonFiniteError",
    "ShapeError",
    "SideCodec",
    "SlotLayout",
    "TkvBitsError",
    "TkvConfig",
    "TkvError",
    "TurboKVCodec",
    "UnsupportedFeatureError",
    "beta_codebook",
    "effective_bits_per_element",
    "fit_codebook",
    "gaussian_codebook",
    "load_config",
    "normalize_tkv_bits",
    "pack_codes",
    "resolve_allocation",
    "shard_kv_heads",
    "unpack_codes",
]
