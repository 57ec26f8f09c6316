"""The calibration bundle: a versioned JSON file that carries everything calibration learned
about one model, validated on load with named errors.

Format (``schema_version`` 1)::

    {
      "format": "tkv-calibration-bundle",
      "schema_version": 1,
      "seed": 0,                                  # rotation seed the codebooks were fit under
      "geometry": {"model": "SmolLM2-135M-Instruct", "num_layers": 30, "num_kv_heads": 3,
                   "head_dim": 64, "layer_types": ["full", ...], "sliding_window": null},
      "layers": [                                 # one entry per layer, in order
        {"k_channel_scales": [...head_dim floats > 0] | null,
         "v_channel_scales": [...] | null,
         "k_channel_offset": [...head_dim floats]           # optional key mean (centering):
                           | [...num_kv_heads*head_dim floats] | null,  # shared, or per KV head
                                                            # (head-major: head h at h*head_dim)
         "k_sink_offset": [...] | null, "v_sink_offset": [...] | null,  # optional, same forms:
                                                            # the codec's sink offsets
         "codebooks": {"k_bits_4": {"centroids": [16 floats], "boundaries": [15 floats]},
                       "v_bits_3": {...}, ...}}   # any subset of k_bits_2..8 / v_bits_2..8
      ],
      "byte_budget_table": {                      # TKV_BITS value -> per-layer widths
        "4.0": {"k_bits": [30 ints], "v_bits": [30 ints], "source": "smartmix" | "uniform"}
      },
      "provenance": {"tool": ..., "tool_version": ..., "corpus": ..., "corpus_sha256": ...,
                     "num_tokens": ..., "date": ...},
      "metrics": {...},                           # free-form measured numbers
      "integrity": "sha256 of the canonical JSON of every other field"
    }

``TKV_BITS`` is the average bits per element across K and V that a row was chosen for; the
real cost of a row, norms included, is :attr:`LayerAllocation.bits_per_element` (priced by
:mod:`tkv.codec.layout`). Resolving a value with no row is a hard
:class:`~tkv.codec.errors.BudgetRowMissingError` listing the rows that exist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .codebooks import Codebook
from .errors import (
    BudgetRowMissingError,
    BundleGeometryError,
    BundleSchemaError,
    CodebookError,
    ShapeError,
    TkvBitsError,
)
from .layout import effective_bits_per_element
from .packing import MAX_BITS, MIN_BITS

__all__ = [
    "BUNDLE_FORMAT",
    "DEFAULT_K_BITS",
    "DEFAULT_V_BITS",
    "SCHEMA_VERSION",
    "CalibrationBundle",
    "LayerAllocation",
    "LayerCalibration",
    "ModelGeometry",
    "normalize_tkv_bits",
    "resolve_allocation",
]

log = logging.getLogger("tkv")

SCHEMA_VERSION = 1
BUNDLE_FORMAT = "tkv-calibration-bundle"
DEFAULT_K_BITS = 4
DEFAULT_V_BITS = 4
LAYER_TYPES = ("full", "sliding")
HF_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}   # config spelling
BUNDLE_FIELDS = ("format", "schema_version", "seed", "geometry", "layers", "byte_budget_table",
                 "provenance", "metrics", "integrity")
GEOMETRY_FIELDS = ("model", "num_layers", "num_kv_heads", "head_dim", "layer_types",
                   "sliding_window")
LAYER_FIELDS = ("k_channel_scales", "v_channel_scales", "codebooks", "k_channel_offset",
                "k_sink_offset", "v_sink_offset")
_RESEAL = ("Re-run tkv-calibrate, or, to keep a deliberate hand edit, reseal the file: "
           "CalibrationBundle.from_dict(json.load(open(PATH)), verify_integrity=False).save(PATH)")


def normalize_tkv_bits(value: str | float | int) -> str:
    """Canonical ``byte_budget_table`` key of a ``TKV_BITS`` value: ``4`` / ``"4"`` → ``"4.0"``.

    Raises:
        TkvBitsError: not a number, not finite, or outside [2.0, 8.0].
    """
    r = repr(value)
    shown = r if len(r) <= 40 else f"{r[:40]}... ({len(r)} characters)"   # never echo 5 KB
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise TkvBitsError(f"TKV_BITS must be a number in [2.0, 8.0], got {shown}") from None
    if not math.isfinite(v) or not 2.0 <= v <= 8.0:
        raise TkvBitsError(f"TKV_BITS must be in [2.0, 8.0], got {shown}")
    return repr(v)


def _fail(path: str, msg: str) -> BundleSchemaError:
    return BundleSchemaError(f"bundle field {path}: {msg}")


def _req(d: Mapping, key: str, path: str) -> Any:
    if not isinstance(d, Mapping):
        raise _fail(path, f"expected an object, got {type(d).__name__}")
    if key not in d:
        raise _fail(f"{path}.{key}", "missing")
    return d[key]


def _int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, f"expected an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _fail(path, f"{v} outside [{lo}, {hi}]")
    return v


_F32_MAX = 3.4028234663852886e38    # largest finite float32
_F32_TINY = 1.1754943508222875e-38  # smallest normal float32


def _keys(d: Any, allowed: tuple[str, ...], path: str) -> None:
    """Refuse keys outside ``allowed``: a misspelled field (``k_chanel_scales``) would
    otherwise be ignored and its calibration silently dropped."""
    if isinstance(d, Mapping):
        extra = sorted(str(k) for k in d if k not in allowed)
        if extra:
            raise _fail(path, f"unknown field(s) {', '.join(map(repr, extra))}; "
                              f"expected only {', '.join(allowed)}")


def _floats(v: Any, path: str, n: int | None = None, positive: bool = False) -> list[float]:
    """A list of ``n`` numbers the codec's float32 tensors hold exactly in range: finite,
    ``|x| <= 3.4e38``, and with ``positive`` at least the smallest normal float32 (1.2e-38) —
    a scale that rounds to 0 or inf in float32 is refused here, on load, not later in a
    codec or kernel."""
    if not isinstance(v, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in v
    ):
        raise _fail(path, "expected a list of numbers")
    if n is not None and len(v) != n:
        raise _fail(path, f"expected {n} numbers, got {len(v)}")
    try:
        vals = [float(x) for x in v]
    except OverflowError:   # an integer beyond the float range
        raise _fail(path, "non-finite number") from None
    if not all(math.isfinite(x) for x in vals):
        raise _fail(path, "non-finite number")
    if not all(abs(x) <= _F32_MAX for x in vals):
        raise _fail(path, "a number beyond the float32 range (|x| > 3.4e38)")
    if positive and not all(x >= _F32_TINY for x in vals):
        raise _fail(path, "every entry must be > 0 (at least 1.2e-38, the smallest normal "
                          "float32)")
    return vals


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry a bundle was calibrated for.

    Attributes:
        num_layers: attention layers. num_kv_heads: KV heads per layer (whole model, not per
        TP rank). head_dim: elements per head. layer_types: ``"full"`` or ``"sliding"`` per
        layer. sliding_window: window in tokens of the sliding layers, or None. model: name.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    model: str = ""

    def __post_init__(self) -> None:
        """Raises ShapeError: a size that is not a positive int, or ``layer_types`` that is
        not one of ``"full"`` / ``"sliding"`` per layer (empty: all ``"full"``)."""
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShapeError(f"ModelGeometry.{name} must be a positive int, got {v!r}")
        types = self.layer_types
        if not isinstance(types, (tuple, list)) or (
                types and (len(types) != self.num_layers
                           or any(t not in LAYER_TYPES for t in types))):
            raise ShapeError(f"ModelGeometry.layer_types must hold {self.num_layers} entries "
                             f"from {LAYER_TYPES} (or be empty: all full), got {types!r}")
        object.__setattr__(self, "layer_types",
                           tuple(types) if types else ("full",) * self.num_layers)

    def to_dict(self) -> dict:
        return {"model": self.model, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "layer_types": list(self.layer_types), "sliding_window": self.sliding_window}

    def name_mismatch(self, served: str | None) -> str | None:
        """The warning engines log when ``served`` (the engine's model name or path) names
        another model than the bundle's ``model`` — neither name containing the other,
        case-insensitive, the last path component only (a local path and a hub name of one
        model differ); None when they match or either is empty. Only a warning: the geometry
        checks decide whether the bundle serves."""
        name = str(served or "").rstrip("/").rsplit("/", 1)[-1].lower()
        mine = self.model.lower()
        if not (mine and name) or mine in name or name in mine:
            return None
        return (f"the calibration bundle was made for {self.model!r}, the served model is "
                f"{served!r}; the geometry matches, so it is used — check TKV_CALIBRATION_FILE")

    def check_layer_kinds(self, layer_types=None, sliding_window=None) -> None:
        """Refuse a served model whose per-layer attention kinds or sliding window differ from
        the ones this bundle was calibrated on (a bundle of another model with the same
        layers / KV heads / head_dim would otherwise serve silently).

        Args:
            layer_types: the model config's per-layer kinds, Hugging Face spelling
                (``"full_attention"`` / ``"sliding_attention"``) or this bundle's
                (``"full"`` / ``"sliding"``); None or a length other than ``num_layers``:
                not compared (the config does not list them).
            sliding_window: the model config's window in tokens; None: not compared.

        Raises:
            BundleGeometryError: naming the first layer that differs, or both windows.
        """
        if isinstance(layer_types, list | tuple) and len(layer_types) == self.num_layers:
            mine = tuple(HF_LAYER_KINDS.get(k, str(k)) for k in layer_types)
            for i, (a, b) in enumerate(zip(self.layer_types, mine, strict=True)):
                if a != b:
                    raise BundleGeometryError(
                        f"calibration bundle for {self.model or 'another model'}: layer {i} is "
                        f"{a!r} attention in the bundle, {b!r} in the model being served (the "
                        "bundle was calibrated for another model)")
        if (self.sliding_window is not None and isinstance(sliding_window, int)
                and not isinstance(sliding_window, bool) and sliding_window != self.sliding_window):
            raise BundleGeometryError(
                f"calibration bundle for {self.model or 'another model'}: sliding_window "
                f"{self.sliding_window}, the model being served {sliding_window}")

    @classmethod
    def from_dict(cls, d: Mapping, path: str = "geometry") -> ModelGeometry:
        n = _int(_req(d, "num_layers", path), f"{path}.num_layers", 1)
        _keys(d, GEOMETRY_FIELDS, path)
        types = d.get("layer_types")
        if types is None or types == []:   # absent or empty: every layer full attention
            types = ["full"] * n
        if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise _fail(f"{path}.layer_types", f"expected {n} entries from {LAYER_TYPES}")
        sw = d.get("sliding_window")
        if sw is not None:
            sw = _int(sw, f"{path}.sliding_window", 1)
        model = d.get("model", "")
        if not isinstance(model, str):
            raise _fail(f"{path}.model", "expected a string")
        return cls(n, _int(_req(d, "num_kv_heads", path), f"{path}.num_kv_heads", 1),
                   _int(_req(d, "head_dim", path), f"{path}.head_dim", 1), tuple(types), sw, model)


def _offset_tensor(vals, head_dim: int, name: str):
    """A flat offset (``head_dim`` floats, or ``num_kv_heads * head_dim`` head-major) as float32
    ``(head_dim,)`` / ``(H, head_dim)``, or None. Raises BundleSchemaError on a bad length."""
    if vals is None:
        return None
    import torch

    n = len(vals)
    if n == 0 or n % head_dim:
        raise BundleSchemaError(f"{name} holds {n} floats; expected head_dim={head_dim} or "
                                f"num_kv_heads*head_dim")
    t = torch.tensor(vals, dtype=torch.float32)
    return t if n == head_dim else t.view(n // head_dim, head_dim)


@dataclass(frozen=True)
class LayerCalibration:
    """What calibration learned for one layer.

    Attributes:
        k_channel_scales, v_channel_scales: float ``(head_dim,)`` lists of positive prescales, or None.
        codebooks: fitted codebooks keyed ``"k_bits_N"`` / ``"v_bits_N"`` (standardized units).
        k_channel_offset: flat float tuple, key mean subtracted before compression, or None (see
            ``TurboKVCodec``'s ``k_channel_offset``; optional, absent in older bundles). Either
            ``head_dim`` floats (one mean shared by all KV heads; older bundles) or
            ``num_kv_heads * head_dim`` floats, head-major (one mean per KV head);
            :meth:`k_offset_tensor` gives the codec's ``(head_dim,)`` / ``(H, head_dim)`` form.
        k_sink_offset, v_sink_offset: the codec's sink offsets (``TurboKVCodec``), stored like
            ``k_channel_offset``; optional (absent in older bundles).
    """

    k_channel_scales: tuple[float, ...] | None = None
    v_channel_scales: tuple[float, ...] | None = None
    codebooks: Mapping[str, Codebook] = field(default_factory=dict)
    k_channel_offset: tuple[float, ...] | None = None
    k_sink_offset: tuple[float, ...] | None = None
    v_sink_offset: tuple[float, ...] | None = None

    def k_offset_heads(self, head_dim: int) -> int | None:
        """KV heads of a per-head key offset (``num_kv_heads * head_dim`` floats); None for a
        shared ``(head_dim,)`` offset or none. The flat length is validated on load."""
        n = 0 if self.k_channel_offset is None else len(self.k_channel_offset)
        return None if n in (0, head_dim) else n // head_dim

    def offset_heads(self, head_dim: int) -> int | None:
        """KV heads of this layer's per-head offsets — the key offset or either sink offset
        (all per-head offsets of a layer hold the bundle's ``num_kv_heads``, validated on load);
        None when every offset is shared or absent. Engines slice such offsets per TP rank."""
        for vals in (self.k_channel_offset, self.k_sink_offset, self.v_sink_offset):
            n = 0 if vals is None else len(vals)
            if n not in (0, head_dim):
                return n // head_dim
        return None

    def k_offset_tensor(self, head_dim: int):
        """float32 ``(head_dim,)`` (shared) or ``(num_kv_heads, head_dim)`` (per head) key mean,
        or None. Raises BundleSchemaError if the flat length is not a multiple of head_dim."""
        return _offset_tensor(self.k_channel_offset, head_dim, "k_channel_offset")

    def sink_offset_tensor(self, side: str, head_dim: int):
        """The ``side`` ("k"/"v") sink offset in the codec's form (as :meth:`k_offset_tensor`),
        or None."""
        name = f"{side}_sink_offset"
        return _offset_tensor(getattr(self, name), head_dim, name)

    def codebook(self, side: str, bits: int) -> Codebook | None:
        """The fitted codebook of ``side`` ("k"/"v") at ``bits``, or None (→ Gaussian default)."""
        return self.codebooks.get(f"{side}_bits_{bits}")

    def to_dict(self) -> dict:
        d = {
            "k_channel_scales": None if self.k_channel_scales is None else list(self.k_channel_scales),
            "v_channel_scales": None if self.v_channel_scales is None else list(self.v_channel_scales),
            "codebooks": {k: cb.to_dict() for k, cb in sorted(self.codebooks.items())},
        }
        for name in ("k_channel_offset", "k_sink_offset", "v_sink_offset"):
            if getattr(self, name) is not None:
                d[name] = list(getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: Mapping, head_dim: int, path: str,
                  num_kv_heads: int | None = None) -> LayerCalibration:
        if not isinstance(d, Mapping):
            raise _fail(path, f"expected an object, got {type(d).__name__}")
        _keys(d, LAYER_FIELDS, path)
        scales = {}
        for side in ("k", "v"):
            key = f"{side}_channel_scales"
            v = d.get(key)
            scales[side] = None if v is None else tuple(
                _floats(v, f"{path}.{key}", head_dim, positive=True))
        cbs_raw = d.get("codebooks", {})
        if not isinstance(cbs_raw, Mapping):
            raise _fail(f"{path}.codebooks", "expected an object")
        cbs = {}
        for key, cb in cbs_raw.items():
            side, _, bits_s = str(key).partition("_bits_")
            canonical = (side in ("k", "v") and bits_s in {str(b) for b in
                                                           range(MIN_BITS, MAX_BITS + 1)})
            if not canonical:   # "k_bits_04" / "k_bits_٤" would load and never be looked up
                raise _fail(f"{path}.codebooks.{key}", "key must be k_bits_N or v_bits_N, N one of "
                                                       "2..8 written as a plain ASCII digit")
            bits = int(bits_s)
            p = f"{path}.codebooks.{key}"
            _keys(cb, ("centroids", "boundaries"), p)
            cents = _floats(_req(cb, "centroids", p), f"{p}.centroids", 1 << bits)
            bounds = _floats(_req(cb, "boundaries", p), f"{p}.boundaries", (1 << bits) - 1)
            try:
                book = Codebook.from_centroids(cents, bits)
            except CodebookError as e:
                raise _fail(p, str(e)) from None
            if max(abs(a - b) for a, b in zip(book.boundaries.tolist(), bounds, strict=True)) > 1e-5:
                raise _fail(f"{p}.boundaries", "boundaries are not the midpoints of the centroids")
            cbs[key] = book
        offsets = {}
        for name in ("k_channel_offset", "k_sink_offset", "v_sink_offset"):
            off = d.get(name)
            offsets[name] = None
            if off is not None:
                p = f"{path}.{name}"
                vals = _floats(off, p)
                allowed = {head_dim} | ({num_kv_heads * head_dim} if num_kv_heads else set())
                if len(vals) not in allowed:
                    want = " or ".join(str(a) for a in sorted(allowed))
                    raise _fail(p, f"expected {want} numbers (head_dim={head_dim} shared, or "
                                   f"num_kv_heads={num_kv_heads} x head_dim per head), "
                                   f"got {len(vals)}")
                offsets[name] = tuple(vals)
        return cls(scales["k"], scales["v"], cbs, offsets["k_channel_offset"],
                   offsets["k_sink_offset"], offsets["v_sink_offset"])


@dataclass(frozen=True)
class LayerAllocation:
    """Per-layer ``(k_bits, v_bits)`` for one ``TKV_BITS`` budget.

    Attributes:
        k_bits, v_bits: one width 2..8 per layer.
        source: ``"smartmix"`` (verified mix), ``"uniform"`` or ``"default"`` (no bundle).
    """

    k_bits: tuple[int, ...]
    v_bits: tuple[int, ...]
    source: str = "uniform"

    def bits_per_element(self, head_dim: int) -> float:
        """Real average bits per K/V element over layers, norms included (tkv.codec.layout)."""
        return sum(effective_bits_per_element(head_dim, kb, vb)
                   for kb, vb in zip(self.k_bits, self.v_bits, strict=True)) / len(self.k_bits)

    def to_dict(self) -> dict:
        return {"k_bits": list(self.k_bits), "v_bits": list(self.v_bits), "source": self.source}

    @classmethod
    def uniform(cls, num_layers: int, k_bits: int, v_bits: int, source: str = "uniform"):
        return cls((k_bits,) * num_layers, (v_bits,) * num_layers, source)

    @classmethod
    def from_dict(cls, d: Mapping, num_layers: int, path: str) -> LayerAllocation:
        _keys(d, ("k_bits", "v_bits", "source"), path)
        out = []
        for side in ("k_bits", "v_bits"):
            v = _req(d, side, path)
            if not isinstance(v, list) or len(v) != num_layers:
                raise _fail(f"{path}.{side}", f"expected a list of {num_layers} widths")
            out.append(tuple(_int(b, f"{path}.{side}[{i}]", MIN_BITS, MAX_BITS)
                             for i, b in enumerate(v)))
        src = d.get("source", "uniform")
        if src not in ("smartmix", "uniform", "default"):
            raise _fail(f"{path}.source", f"unknown source {src!r}")
        return cls(out[0], out[1], src)


# ----------------------------------------------------------------------------- bundle
@dataclass(frozen=True)
class CalibrationBundle:
    """A validated calibration bundle (see module docstring for the JSON format).

    Build one with the constructor (calibration does), or read one with :meth:`load`.
    ``save`` writes canonical JSON with an ``integrity`` hash; ``load`` refuses a file whose
    hash does not match (corruption) with BundleSchemaError.
    """

    geometry: ModelGeometry
    layers: tuple[LayerCalibration, ...]
    byte_budget_table: Mapping[str, LayerAllocation]
    provenance: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.layers) != self.geometry.num_layers:
            raise BundleSchemaError(
                f"bundle has {len(self.layers)} layer entries for {self.geometry.num_layers} layers")
        table = {}
        for key, alloc in self.byte_budget_table.items():
            if len(alloc.k_bits) != self.geometry.num_layers or len(alloc.v_bits) != self.geometry.num_layers:
                raise BundleSchemaError(f"byte_budget_table[{key}] does not cover every layer")
            table[normalize_tkv_bits(key)] = alloc
        object.__setattr__(self, "byte_budget_table", table)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """JSON-ready dict, ``integrity`` included."""
        body = {
            "format": BUNDLE_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "seed": self.seed,
            "geometry": self.geometry.to_dict(),
            "layers": [lay.to_dict() for lay in self.layers],
            "byte_budget_table": {k: a.to_dict() for k, a in
                                  sorted(self.byte_budget_table.items(), key=lambda kv: float(kv[0]))},
            "provenance": dict(self.provenance),
            "metrics": dict(self.metrics),
        }
        body["integrity"] = _digest(body)
        return body

    @classmethod
    def from_dict(cls, d: Any, verify_integrity: bool = True) -> CalibrationBundle:
        """Validate and build.

        ``verify_integrity``: require the ``integrity`` field and check it (default). False
        accepts a deliberately hand-edited bundle — every field is still validated — so that
        ``CalibrationBundle.from_dict(json.load(f), verify_integrity=False).save(path)`` reseals
        it; engines always verify.

        Raises:
            BundleSchemaError: naming the first offending field, an unknown field, a missing or
                mismatched ``integrity``.
        """
        if not isinstance(d, Mapping):
            raise BundleSchemaError("a bundle must be a JSON object")
        if d.get("format") != BUNDLE_FORMAT:
            raise _fail("format", f"expected {BUNDLE_FORMAT!r}, got {d.get('format')!r}")
        ver = d.get("schema_version")
        if isinstance(ver, bool) or not isinstance(ver, int) or ver != SCHEMA_VERSION:
            raise _fail("schema_version", f"this tkv reads version {SCHEMA_VERSION}, got {ver!r}")
        _keys(d, BUNDLE_FIELDS, "bundle")
        if verify_integrity:
            if "integrity" not in d:
                raise BundleSchemaError(
                    "bundle has no integrity field: tkv writes one into every bundle, so this "
                    f"file was edited or built by hand. {_RESEAL}")
            body = {k: v for k, v in d.items() if k != "integrity"}
            if _digest(body) != d["integrity"]:
                raise BundleSchemaError(
                    "bundle integrity check failed: the file was modified or corrupted "
                    f"after it was written. {_RESEAL}")
        geo = ModelGeometry.from_dict(_req(d, "geometry", "bundle"))
        layers_raw = _req(d, "layers", "bundle")
        if not isinstance(layers_raw, list) or len(layers_raw) != geo.num_layers:
            raise _fail("layers", f"expected {geo.num_layers} layer entries")
        layers = tuple(LayerCalibration.from_dict(x, geo.head_dim, f"layers[{i}]",
                                                  geo.num_kv_heads)
                       for i, x in enumerate(layers_raw))
        table_raw = _req(d, "byte_budget_table", "bundle")
        if not isinstance(table_raw, Mapping) or not table_raw:
            raise _fail("byte_budget_table", "expected a non-empty object")
        table = {}
        for key, row in table_raw.items():
            try:
                norm = normalize_tkv_bits(key)
            except TkvBitsError as e:
                raise _fail(f"byte_budget_table.{key}", str(e)) from None
            if norm in table:
                raise _fail(f"byte_budget_table.{key}", f"a second row for TKV_BITS={norm}")
            table[norm] = LayerAllocation.from_dict(row, geo.num_layers, f"byte_budget_table.{key}")
        prov = d.get("provenance", {})
        metrics = d.get("metrics", {})
        if not isinstance(prov, Mapping) or not isinstance(metrics, Mapping):
            raise _fail("provenance/metrics", "expected objects")
        seed = _int(d.get("seed", 0), "seed", 0, 2 ** 64 - 1)   # the codec's check_seed
        return cls(geo, layers, table, dict(prov), dict(metrics), seed)

    def save(self, path: str | os.PathLike) -> Path:
        """Write canonical JSON (sorted keys). Returns the path.

        The bundle is validated as :meth:`load` will read it before anything is written, so a
        bundle built with bad contents (widths outside 2..8, scales of the wrong length, NaN
        metrics, ...) never reaches disk.

        Raises:
            BundleSchemaError: the first offending field (as :meth:`from_dict` names it).
        """
        d = self.to_dict()
        type(self).from_dict(json.loads(json.dumps(d)))
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationBundle:
        """Read and validate a bundle file.

        Raises:
            FileNotFoundError: no such file (message names TKV_CALIBRATION_FILE's usual role).
            BundleSchemaError: not JSON, wrong format/version, bad field, integrity mismatch.
        """
        p = Path(path)
        if p.is_dir():
            raise FileNotFoundError(f"calibration bundle {str(p)!r} is a directory, not a file")
        if not p.is_file():
            raise FileNotFoundError(f"calibration bundle not found: {str(p)!r}")
        try:
            d = json.loads(p.read_text())
        except (ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError, and
            # an integer longer than Python's int-conversion limit (4,300 digits) are ValueErrors
            raise BundleSchemaError(f"calibration bundle {str(p)!r} is not valid JSON (or nests "
                                    f"deeper, or holds a longer integer, than Python's parser "
                                    f"allows): {str(e)[:200]}") from None
        try:
            return cls.from_dict(d)
        except BundleSchemaError as e:
            raise BundleSchemaError(f"calibration bundle {str(p)!r}: {e}") from None

    # ------------------------------------------------------------------ use
    def check_geometry(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse a bundle made for another model.

        Raises:
            BundleGeometryError: naming every field that differs.
        """
        g = self.geometry
        diffs = [f"{n}: bundle {a}, model {b}" for n, a, b in (
            ("num_layers", g.num_layers, num_layers), ("num_kv_heads", g.num_kv_heads, num_kv_heads),
            ("head_dim", g.head_dim, head_dim)) if a != b]
        if diffs:
            raise BundleGeometryError(
                f"calibration bundle for {g.model or 'another model'} does not match the model "
                f"being served ({'; '.join(diffs)})")

    def budgets(self) -> list[str]:
        """The ``TKV_BITS`` rows present, ascending."""
        return sorted(self.byte_budget_table, key=float)

    def allocation(self, tkv_bits: str | float) -> LayerAllocation:
        """The per-layer widths for ``tkv_bits``.

        Raises:
            TkvBitsError: value not in [2, 8]. BudgetRowMissingError: no row (lists the rows).
        """
        key = normalize_tkv_bits(tkv_bits)
        if key not in self.byte_budget_table:
            raise BudgetRowMissingError(
                f"TKV_BITS={tkv_bits} has no row in the calibration bundle's byte_budget_table; "
                f"rows present: {', '.join(self.budgets())}")
        return self.byte_budget_table[key]

    def codec(self, layer: int, k_bits: int, v_bits: int, device="cpu", heads=None, **kwargs):
        """A :class:`~tkv.codec.TurboKVCodec` for ``layer`` at the given widths, with this bundle's
        channel scales, fitted codebooks (Gaussian where none was fitted) and seed.

        ``heads``: global KV-head indices this codec serves (e.g. a TP rank's ``range``); the
        per-head offsets (key offset, sink offsets) are sliced to those rows (shared ones are
        unaffected). None: all ``num_kv_heads`` heads.

        Raises:
            IndexError: ``layer`` not an int in range. BundleGeometryError: ``heads`` not a
            collection of ints inside the bundle's ``num_kv_heads``.
        """
        from .codec import TurboKVCodec

        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.geometry.num_layers:
            raise IndexError(f"layer must be an int in 0..{self.geometry.num_layers - 1}, got "
                             f"{layer!r}")
        cal = self.layers[layer]
        d = self.geometry.head_dim
        offs = [cal.k_offset_tensor(d), cal.sink_offset_tensor("k", d),
                cal.sink_offset_tensor("v", d)]
        if heads is not None:
            nh = self.geometry.num_kv_heads
            try:
                idx = list(heads)
            except TypeError:
                raise BundleGeometryError(f"heads must be a collection of KV-head indices "
                                          f"(e.g. range(0, {nh})), got {heads!r}") from None
            if not idx or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < nh
                              for h in idx):
                raise BundleGeometryError(
                    f"KV heads {idx} outside the bundle's {nh} KV heads (0..{nh - 1})")
            offs = [m[idx] if m is not None and m.dim() == 2 else m for m in offs]
        return TurboKVCodec(
            d, k_bits=k_bits, v_bits=v_bits, device=device, seed=self.seed,
            k_channel_scales=cal.k_channel_scales, v_channel_scales=cal.v_channel_scales,
            k_codebook=cal.codebook("k", k_bits), v_codebook=cal.codebook("v", v_bits),
            k_channel_offset=offs[0], k_sink_offset=offs[1], v_sink_offset=offs[2], **kwargs)

    def codecs(self, tkv_bits: str | float, device="cpu", **kwargs) -> list:
        """One codec per layer for the ``tkv_bits`` row."""
        a = self.allocation(tkv_bits)
        return [self.codec(i, kb, vb, device, **kwargs)
                for i, (kb, vb) in enumerate(zip(a.k_bits, a.v_bits, strict=True))]


def _digest(body: Mapping) -> str:
    """sha256 of the canonical JSON of ``body``.

    Raises:
        BundleSchemaError: ``body`` holds NaN / Infinity (not JSON; e.g. a NaN metric) or a
            value JSON cannot encode."""
    try:
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as e:
        raise BundleSchemaError(f"bundle holds a value JSON cannot carry (NaN, Infinity or a "
                                f"non-JSON type, e.g. in metrics or provenance): {e}") from None
    return hashlib.sha256(canon.encode()).hexdigest()


def resolve_allocation(bundle: CalibrationBundle | None, tkv_bits: str | float | None,
                       num_layers: int, num_kv_heads: int | None = None,
                       head_dim: int | None = None) -> LayerAllocation:
    """Turn ``(bundle, TKV_BITS)`` into per-layer widths, the way engines do at startup.

    * bundle given: geometry checked (if num_kv_heads/head_dim given), row for ``tkv_bits``
      required (``None`` → "4.0").
    * no bundle: uniform K4V4 with a loud warning (meant for tests and smoke runs);
      a ``tkv_bits`` other than 4.0 without a bundle is refused, since only a calibrated
      bundle knows how to spend another budget.

    Raises:
        TkvBitsError, BudgetRowMissingError, BundleGeometryError.
    """
    key = normalize_tkv_bits(4.0 if tkv_bits is None else tkv_bits)
    if bundle is None:
        if key != "4.0":
            raise BudgetRowMissingError(
                f"TKV_BITS={tkv_bits} needs a calibration bundle (TKV_CALIBRATION_FILE); "
                "without one only the uniform K4V4 default (TKV_BITS=4.0) is available")
        msg = ("tkv: no calibration bundle (TKV_CALIBRATION_FILE unset): using uniform K4V4 "
               "with Gaussian codebooks and no channel scales. Quality is uncalibrated; run "
               "`tkv-calibrate` for production.")
        warnings.warn(msg, UserWarning, stacklevel=2)
        log.warning(msg)
        return LayerAllocation.uniform(num_layers, DEFAULT_K_BITS, DEFAULT_V_BITS, "default")
    if num_kv_heads is not None and head_dim is not None:
        bundle.check_geometry(num_layers, num_kv_heads, head_dim)
    elif bundle.geometry.num_layers != num_layers:
        raise BundleGeometryError(
            f"bundle has {bundle.geometry.num_layers} layers, model has {num_layers}")
    return bundle.allocation(key)


