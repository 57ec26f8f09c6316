"""CPU benchmark of the K codec: throughput and relative MSE, side by side in one run.

Compares, at K2/K3/K4/K8, head_dim 128, on the same input vectors:

* ``ours``        — ``tkv.codec.TurboKVCodec.compress_k`` / ``decompress_k`` (this repository;
                    ``check_finite=False``, the hot-path setting; the default finite check is
                    costed separately in the profile), default (Gaussian Lloyd-Max) codebook and,
                    as a second row, its ``k_codebook="beta"`` option (exact sphere marginal);
* ``turbo-attn``  — the peer ``turbo-attn==0.24.4`` from PyPI, ``tkv.TurboKVCodec(head_dim,
                    bit_width).compress_k`` / ``decompress_k`` (its CPU path: dense WHT matmul,
                    ``searchsorted``, bf16 norms, its own K norm correction on). Its import name
                    ``tkv`` clashes with our PEP 420 namespace, so it runs in a worker subprocess
                    from its own venv (created once with ``uv``, cached under
                    ``~/.cache/tkv-bench/turbo-attn-0.24.4``) that answers JSON lines;
* ``int{b}-asym`` — a plain per-token (per vector) asymmetric uniform quantizer written below in
                    plain torch: ``zero = min(x)``, ``scale = (max(x) - zero) / (2^b - 1)``, both
                    stored as fp16, codes packed ``b`` bits each.

Inputs (one fixed seed, so the peer subprocess regenerates bit-identical tensors; a checksum is
compared): ``gaussian`` = i.i.d. N(0, 1) K-like vectors; ``outlier`` = the same vectors with a few
fixed channels (default 4 of 128) scaled ×10, as real keys have (KIVI, Liu et al. 2024, Sec. 3;
KVQuant, Hooper et al. 2024, Sec. 3.1).

Metrics: throughput in vectors/s for compress, decompress and the round trip (median over
``--repeats`` timed repeats after ``--warmup`` untimed ones, ``torch.set_num_threads(--threads)``
fixed in both processes; each repeat times every method once, in a rotating order, so load
changes on a shared machine hit all methods alike); relative MSE = mean over vectors of ``‖x − x̂‖² / ‖x‖²``; bytes per vector = everything
the method stores per vector (codes + norm, or codes + scale + zero), measured from the returned
tensors. Ratios are against ``ours`` at the same bit width. For the MSE comparison the per-vector
errors of each method are paired with ours on the same vectors and the mean difference is given
with a 95 % confidence interval.

A profile of our codec follows: time per step (validation, rotation, norm, bucketize, K norm
correction, packing; unpack, centroid gather, inverse rotation), the top aten ops from
``torch.profiler``, and bit-exact prototypes of faster steps (for the codec's maintainer; the codec
itself is not changed here).

Run (from the repository root)::

    .venv/bin/python benchmarks/codec_cpu.py                       # full run, markdown to stdout
    .venv/bin/python benchmarks/codec_cpu.py --no-peer --batch 4096 --repeats 2   # quick look

Results are recorded in ``benchmarks/results/codec_cpu.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # peer venv has no numpy
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # torch.profiler: no "gpuGetDeviceCount" noise on CPU
import torch  # noqa: E402

PEER_DIST = "turbo-attn"
PEER_VERSION = "0.24.4"
DEFAULT_PEER_VENV = Path.home() / ".cache" / "tkv-bench" / f"turbo-attn-{PEER_VERSION}"
_VENV_OK_MARKER = ".tkv-bench-ok"
DATASETS = ("gaussian", "outlier")


# ---------------------------------------------------------------------------------------- inputs
def make_inputs(kind: str, batch: int, head_dim: int, seed: int, n_outlier: int,
                outlier_scale: float) -> torch.Tensor:
    """float32 ``(batch, head_dim)`` K-like vectors, bit-identical for equal arguments and torch.

    ``gaussian``: i.i.d. N(0, 1). ``outlier``: the same, with ``n_outlier`` fixed channels
    (chosen by the seed) multiplied by ``outlier_scale``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, head_dim, generator=g, dtype=torch.float32)
    if kind == "outlier":
        ch = torch.randperm(head_dim, generator=g)[:n_outlier]
        x[:, ch] *= outlier_scale
    elif kind != "gaussian":
        raise ValueError(f"unknown data set {kind!r}; choose from {DATASETS}")
    return x


def checksum(x: torch.Tensor) -> float:
    """A float64 fingerprint of ``x`` (to prove the peer subprocess saw the same vectors)."""
    w = torch.arange(1, x.numel() + 1, dtype=torch.float64).reshape(x.shape).remainder_(977)
    return float((x.double() * w).sum())


# ---------------------------------------------------------------------------------------- timing
def rel_errors(x: torch.Tensor, xr: torch.Tensor) -> torch.Tensor:
    """Per-vector ``‖x − x̂‖² / ‖x‖²`` in float64, shape ``(batch,)``."""
    xd = x.double()
    return (xd - xr.double()).pow(2).sum(-1) / xd.pow(2).sum(-1)


class LocalMethod:
    """One codec under test in this process: ``compress(x) -> payload`` tensors and
    ``decompress(*payload) -> x̂`` on a fixed input ``x`` (warmed up on construction)."""

    def __init__(self, compress: Callable, decompress: Callable, x: torch.Tensor, warmup: int):
        self.compress, self.decompress, self.x = compress, decompress, x
        for _ in range(warmup):
            decompress(*compress(x))

    def time_once(self) -> tuple[float, float]:
        """One timed call of each: (compress seconds, decompress seconds)."""
        t0 = time.perf_counter()
        payload = self.compress(self.x)
        t1 = time.perf_counter()
        self.decompress(*payload)
        return t1 - t0, time.perf_counter() - t1

    def quality(self) -> tuple[dict, torch.Tensor]:
        """(stats with ``rel_mse`` and ``bytes_per_vector``, per-vector relative errors).

        ``bytes_per_vector`` sums every tensor of the payload (codes, norms, scales, ...)
        divided by the number of vectors.
        """
        payload = self.compress(self.x)
        errs = rel_errors(self.x, self.decompress(*payload))
        return {"rel_mse": float(errs.mean()),
                "bytes_per_vector": sum(t.numel() * t.element_size() for t in payload)
                / self.x.shape[0],
                "payload": [f"{t.dtype}{list(t.shape[1:])}" for t in payload]}, errs


def summarize(times: list[tuple[float, float]]) -> dict:
    """Medians (seconds) of compress, decompress and per-repeat round trip, and the round-trip
    spread ``(max − min) / median``."""
    tc = [t[0] for t in times]
    td = [t[1] for t in times]
    tr = [a + b for a, b in times]
    return {"compress_s": statistics.median(tc), "decompress_s": statistics.median(td),
            "roundtrip_s": statistics.median(tr),
            "roundtrip_spread": (max(tr) - min(tr)) / statistics.median(tr)}


def time_median(fn: Callable, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---------------------------------------------------------------------------------------- int-b baseline
def pack_uint(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``(N, n)`` (< 2**bits, any int dtype) LSB-first into uint8 ``(N, ceil(n*bits/8))``.

    Plain torch: groups of ``g = 8/gcd(bits, 8)`` codes form one ``g*bits``-bit word (int32 when it
    fits, else int64), built with ``g`` shifted ORs and split into bytes with ``g*bits/8`` shifts.
    """
    if bits == 8:
        return q.to(torch.uint8)
    n_vec, n = q.shape
    g = 8 // math.gcd(bits, 8)
    gb = g * bits // 8
    ng = -(-n // g)
    wt = torch.int32 if g * bits <= 31 else torch.int64
    c = q.to(wt)
    if ng * g != n:
        c = torch.nn.functional.pad(c, (0, ng * g - n))
    c = c.reshape(n_vec, ng, g)
    w = c[..., 0].clone()
    for i in range(1, g):
        w |= c[..., i] << (i * bits)
    out = torch.empty(n_vec, ng, gb, dtype=torch.uint8)
    for j in range(gb):
        out[..., j] = (w >> (8 * j)) & 0xFF
    return out.reshape(n_vec, ng * gb)[:, : (n * bits + 7) // 8]


def unpack_uint(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: uint8 ``(N, ceil(n*bits/8))`` → uint8 codes ``(N, n)``."""
    if bits == 8:
        return p
    n_vec = p.shape[0]
    g = 8 // math.gcd(bits, 8)
    gb = g * bits // 8
    ng = -(-n // g)
    wt = torch.int32 if g * bits <= 31 else torch.int64
    if ng * gb != p.shape[1]:
        p = torch.nn.functional.pad(p, (0, ng * gb - p.shape[1]))
    p = p.reshape(n_vec, ng, gb).to(wt)
    w = p[..., 0].clone()
    for j in range(1, gb):
        w |= p[..., j] << (8 * j)
    out = torch.empty(n_vec, ng, g, dtype=torch.uint8)
    mask = (1 << bits) - 1
    for i in range(g):
        out[..., i] = (w >> (i * bits)) & mask
    return out.reshape(n_vec, ng * g)[:, :n]


class AsymIntBaseline:
    """Per-token asymmetric uniform ``bits``-bit quantizer (the usual "int4 per-token" KV cache).

    ``x̂ = zero + scale · q`` with ``q = round((x − zero) / scale) ∈ [0, 2^b − 1]``,
    ``zero = min_i x_i`` and ``scale = (max_i x_i − zero) / (2^b − 1)`` per vector, both stored
    as float16 (4 bytes per vector on top of ``ceil(d·b/8)`` code bytes).
    """

    def __init__(self, bits: int, head_dim: int):
        self.bits = bits
        self.head_dim = head_dim
        self.qmax = (1 << bits) - 1

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float ``(N, d)`` → (uint8 codes ``(N, ceil(d·b/8))``, fp16 scale ``(N,)``, fp16 zero ``(N,)``)."""
        xf = x.float()
        mn, mx = torch.aminmax(xf, dim=-1)
        zero16 = mn.to(torch.float16)
        z = zero16.float()
        scale16 = ((mx - z) / self.qmax).to(torch.float16)
        s = scale16.float().clamp_min(1e-8)
        q = torch.round((xf - z.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, self.qmax)
        return pack_uint(q.to(torch.uint8), self.bits), scale16, zero16

    def decompress(self, packed: torch.Tensor, scale16: torch.Tensor,
                   zero16: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`compress`: float32 ``(N, d)``."""
        q = unpack_uint(packed, self.bits, self.head_dim).float()
        return torch.addcmul(zero16.float().unsqueeze(-1), q, scale16.float().unsqueeze(-1))


# ---------------------------------------------------------------------------------------- peer (turbo-attn)
def ensure_peer_venv(venv: Path, torch_version: str) -> Path:
    """Create (once) a venv with ``turbo-attn==PEER_VERSION`` (``--no-deps``) and ``torch``.

    ``uv pip install torch==X`` resolves against the index but takes the wheels from uv's cache
    when the workspace venv was synced with the same torch (about a second, no download).
    Returns the venv's python. Raises RuntimeError when ``uv`` is missing or a step fails.
    """
    py = venv / "bin" / "python"
    if (venv / _VENV_OK_MARKER).exists() and py.exists():
        return py
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("`uv` not found on PATH; install it (pip install uv) or pass --no-peer")
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [uv, "venv", "--quiet", "--python", sys.executable, str(venv)],
        [uv, "pip", "install", "--quiet", "--python", str(py), "--no-deps",
         f"{PEER_DIST}=={PEER_VERSION}"],
        [uv, "pip", "install", "--quiet", "--python", str(py), f"torch=={torch_version}"],
    ]
    for cmd in steps:
        print(f"[peer venv] {' '.join(cmd)}", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"peer venv step failed ({r.returncode}): {' '.join(cmd)}\n"
                               f"{r.stderr[-2000:]}")
    (venv / _VENV_OK_MARKER).write_text(f"{PEER_DIST}=={PEER_VERSION} torch=={torch_version}\n")
    return py


class PeerProcess:
    """This script in ``--peer-worker`` mode under the peer venv's python, driven over JSON lines
    on stdin/stdout, so its timed calls can be interleaved with ours repeat by repeat."""

    def __init__(self, py: Path, spec: dict, workdir: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.stderr_path = workdir / "peer_stderr.txt"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [str(py), str(Path(__file__).resolve()), "--peer-worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env=env, cwd=workdir, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"peer worker died ({self.proc.returncode}):\n"
                               f"{self.stderr_path.read_text()[-4000:]}")
        return json.loads(line)

    def request(self, **msg) -> dict:
        """Send one command, return the worker's JSON reply."""
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.request(op="quit")
            self.proc.wait(timeout=60)
        self._stderr.close()


class PeerMethod:
    """turbo-attn's codec for one (data set, bits), living in a :class:`PeerProcess`."""

    def __init__(self, peer: PeerProcess, dataset: str, bits: int):
        self.peer = peer
        self.prepared = peer.request(op="prepare", dataset=dataset, bits=bits)

    def time_once(self) -> tuple[float, float]:
        r = self.peer.request(op="time")
        return r["c"], r["d"]

    def quality(self) -> tuple[dict, torch.Tensor]:
        return dict(self.prepared), torch.load(self.prepared["err_path"])


def peer_worker(spec_json: str) -> None:
    """Entry point inside the peer venv: serve prepare/time/quit commands (JSON lines)."""
    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    import tkv  # the peer's package (its own top-level tkv), not our namespace
    from tkv import TurboKVCodec as PeerCodec

    if getattr(tkv, "__version__", None) != PEER_VERSION:
        raise RuntimeError(f"expected turbo-attn {PEER_VERSION}, imported {tkv!r}")

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"version": tkv.__version__, "module": tkv.__file__, "torch": torch.__version__})
    inputs: dict[str, torch.Tensor] = {}
    method = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            reply({})
            return
        if msg["op"] == "prepare":
            ds, bits = msg["dataset"], msg["bits"]
            if ds not in inputs:
                inputs[ds] = make_inputs(ds, spec["batch"], spec["head_dim"], spec["seed"],
                                         spec["n_outlier"], spec["outlier_scale"])
            x = inputs[ds]
            codec = PeerCodec(head_dim=spec["head_dim"], bit_width=bits, device="cpu")
            method = LocalMethod(codec.compress_k, codec.decompress_k, x, spec["warmup"])
            stats, errs = method.quality()
            err_path = Path(spec["err_dir"]) / f"peer_{ds}_{bits}.pt"
            torch.save(errs, err_path)
            stats.update(checksum=checksum(x), err_path=str(err_path),
                         declared_bytes_per_vector=codec.bytes_per_k_vector,
                         norm_dtype=codec.norm_dtype, k_norm_correction=codec.k_norm_correction)
            reply(stats)
        elif msg["op"] == "time":
            c, d = method.time_once()
            reply({"c": c, "d": d})
        else:
            raise ValueError(f"unknown op {msg['op']!r}")


# ---------------------------------------------------------------------------------------- profile (ours)
def profile_ours(x: torch.Tensor, bits_list: list[int], warmup: int, repeats: int) -> list[dict]:
    """Time each step of our K compress/decompress separately (ms per batch), for each width.

    The steps call the codec's own building blocks (``rotation``, ``boundaries``, ``centroids``,
    ``pack_codes``/``unpack_codes``) in the order :meth:`tkv.codec.codec.SideCodec.quantize` and
    ``decompress`` use them; "end-to-end" is the real ``compress_k`` / ``decompress_k``.
    """
    rows = []
    for bits in bits_list:
        for name, fn in _profile_steps(x, bits).items():
            rows.append({"bits": bits, "step": name, "ms": 1e3 * time_median(fn, warmup, repeats)})
    return rows


def _profile_steps(x: torch.Tensor, bits: int) -> dict[str, Callable]:
    from tkv.codec import TurboKVCodec
    from tkv.codec.packing import pack_codes, unpack_codes
    from tkv.codec.validation import check_vectors

    d = x.shape[-1]
    codec = TurboKVCodec(d, bits, device="cpu", check_finite=False)
    side = codec.k
    rot = codec.rotation
    cent = (side.centroids.double() / math.sqrt(d)).float()

    def norm_scale(y: torch.Tensor) -> torch.Tensor:
        n = torch.linalg.vector_norm(y, dim=-1)
        return y * torch.where(n > 0, math.sqrt(d) / n, torch.zeros_like(n)).unsqueeze(-1)

    y = rot.forward(x)
    z = norm_scale(y)
    codes = torch.bucketize(z, side.boundaries)
    packed, norms = codec.compress_k(x)
    if not torch.equal(pack_codes(codes, bits), packed):
        raise RuntimeError("profile steps diverge from the codec's compress_k")
    return {
        "c: validate (check_finite=True)": lambda: check_vectors(x, d, codec.device, "K", True),
        "c: rotate (WHT)": lambda: rot.forward(x),
        "c: norm + scale": lambda: norm_scale(y),
        "c: bucketize": lambda: torch.bucketize(z, side.boundaries),
        "c: K norm correction (gather + norm)": lambda: torch.linalg.vector_norm(cent[codes],
                                                                                dim=-1),
        "c: pack": lambda: pack_codes(codes, bits),
        "c: end-to-end compress_k": lambda: codec.compress_k(x),
        "d: unpack": lambda: unpack_codes(packed, bits, d),
        "d: gather centroids x norm": lambda: cent[codes] * norms.float().unsqueeze(-1),
        "d: inverse rotate (WHT)": lambda: rot.inverse(y),
        "d: end-to-end decompress_k": lambda: codec.decompress_k(packed, norms),
    }


def profiler_top_ops(x: torch.Tensor, bits: int, top: int = 8) -> list[tuple[str, str, float]]:
    """``torch.profiler`` self-CPU time of the top aten ops of one compress_k + decompress_k."""
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")

    from tkv.codec import TurboKVCodec

    codec = TurboKVCodec(x.shape[-1], bits, device="cpu", check_finite=False)
    packed, norms = codec.compress_k(x)
    codec.decompress_k(packed, norms)
    rows = []
    for phase, fn in (("compress_k", lambda: codec.compress_k(x)),
                      ("decompress_k", lambda: codec.decompress_k(packed, norms))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        rows += [(phase, e.key, e.self_cpu_time_total / 1e3) for e in ev[:top]]
    return rows


def prototypes(x: torch.Tensor, bits_list: list[int], warmup: int,
               repeats: int) -> list[dict]:
    """Bit-exact faster variants of our codec's hottest steps (ms per batch), each checked with
    ``torch.equal`` against the codec's own step. Suggestions for the codec, not used by it."""
    from tkv.codec import TurboKVCodec
    from tkv.codec.packing import pack_codes, unpack_codes

    d = x.shape[-1]
    rows = []
    codec = TurboKVCodec(d, 4, device="cpu", check_finite=False)
    rot = codec.rotation
    dense = rot.matrix(torch.float64).float().T.contiguous()  # x @ dense == R x
    y_ref = rot.forward(x)
    ok = torch.allclose(x @ dense, y_ref, atol=1e-5)
    rows.append({"bits": "all", "step": "rotate", "current": "factored WHT (16x16 bmm + GEMM)",
                 "cur_ms": 1e3 * time_median(lambda: rot.forward(x), warmup, repeats),
                 "proto": "dense d×d GEMM (x @ Rᵀ), allclose 1e-5" + ("" if ok else " FAILED"),
                 "proto_ms": 1e3 * time_median(lambda: x @ dense, warmup, repeats)})
    for bits in bits_list:
        side = TurboKVCodec(d, bits, device="cpu", check_finite=False).k
        bnd = side.boundaries
        bl = bnd.tolist()
        z = y_ref * (math.sqrt(d) / torch.linalg.vector_norm(y_ref, dim=-1)).unsqueeze(-1)
        codes = torch.bucketize(z, bnd)

        def cmp_count(z=z, bl=bl):
            acc = torch.zeros(z.shape, dtype=torch.uint8)
            for b in bl:  # count(boundary < z) == bucketize(z, boundaries, right=False)
                acc += z > b
            return acc

        if bits <= 5:
            assert torch.equal(cmp_count().long(), codes)
            rows.append({"bits": bits, "step": "bucketize", "current": "torch.bucketize → int64",
                         "cur_ms": 1e3 * time_median(lambda z=z, b=bnd: torch.bucketize(z, b),
                                                     warmup, repeats),
                         "proto": f"{len(bl)} compares summed into uint8",
                         "proto_ms": 1e3 * time_median(cmp_count, warmup, repeats)})
        else:
            assert torch.equal(torch.bucketize(z, bnd, out_int32=True).long(), codes)
            rows.append({"bits": bits, "step": "bucketize", "current": "torch.bucketize → int64",
                         "cur_ms": 1e3 * time_median(lambda z=z, b=bnd: torch.bucketize(z, b),
                                                     warmup, repeats),
                         "proto": "torch.bucketize(out_int32=True)",
                         "proto_ms": 1e3 * time_median(
                             lambda z=z, b=bnd: torch.bucketize(z, b, out_int32=True),
                             warmup, repeats)})
        packed, norms = side.compress(x)
        if 8 % bits == 0:  # whole codes per byte: decode = one gather from a (256, 8/b) table
            cent = (side.centroids.double() / math.sqrt(d)).float()
            per = 8 // bits
            byte = torch.arange(256)
            lut = cent[(byte.unsqueeze(-1) >> (torch.arange(per) * bits)) & ((1 << bits) - 1)]
            nf = norms.float().unsqueeze(-1)

            def cur_dec(p=packed, b=bits, cent=cent, nf=nf):
                return cent[unpack_codes(p, b, d)] * nf

            def lut_dec(p=packed, lut=lut, nf=nf):
                return lut.index_select(0, p.reshape(-1).long()).reshape(p.shape[0], d).mul_(nf)

            assert torch.equal(cur_dec(), lut_dec())
            rows.append({"bits": bits, "step": "unpack + gather × norm",
                         "current": "unpack_codes → int64, centroids[codes]",
                         "cur_ms": 1e3 * time_median(cur_dec, warmup, repeats),
                         "proto": f"byte LUT (256×{per}) index_select on the packed bytes",
                         "proto_ms": 1e3 * time_median(lut_dec, warmup, repeats)})
        if bits == 8:
            continue
        cu8 = codes.to(torch.uint8)
        packed = pack_codes(codes, bits)
        assert torch.equal(pack_uint(cu8, bits), packed)
        assert torch.equal(unpack_uint(packed, bits, d).long(), codes)
        rows.append({"bits": bits, "step": "pack", "current": "pack_codes (int64 words, sum)",
                     "cur_ms": 1e3 * time_median(lambda c=codes, b=bits: pack_codes(c, b),
                                                 warmup, repeats),
                     "proto": "uint8 codes, int32 words, shifted ORs (pack_uint)",
                     "proto_ms": 1e3 * time_median(lambda c=cu8, b=bits: pack_uint(c, b),
                                                   warmup, repeats)})
        rows.append({"bits": bits, "step": "unpack", "current": "unpack_codes → int64",
                     "cur_ms": 1e3 * time_median(lambda p=packed, b=bits: unpack_codes(p, b, d),
                                                 warmup, repeats),
                     "proto": "unpack_uint → uint8 (+ .long() for the gather)",
                     "proto_ms": 1e3 * time_median(
                         lambda p=packed, b=bits: unpack_uint(p, b, d).long(), warmup, repeats)})
    return rows


# ---------------------------------------------------------------------------------------- report
def _mvs(batch: int, s: float) -> str:
    return f"{batch / s / 1e6:.3f}"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent,
                              check=False).stdout.strip() or "?"
    except OSError:
        return "?"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=65536, help="vectors per call (default 65536)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bits", default="2,3,4,8", help="comma-separated widths (default 2,3,4,8)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls per measurement")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--n-outlier", type=int, default=4, help="outlier channels in 'outlier'")
    p.add_argument("--outlier-scale", type=float, default=10.0)
    p.add_argument("--no-peer", action="store_true", help="skip turbo-attn (no venv, no uv)")
    p.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    p.add_argument("--no-profile", action="store_true", help="skip the profile of our codec")
    p.add_argument("--output", type=Path, help="also write the markdown report here")
    p.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.peer_worker:
        peer_worker(args.peer_worker)
        return 0

    from tkv.codec import TurboKVCodec

    torch.set_num_threads(args.threads)
    bits_list = [int(b) for b in args.bits.split(",")]
    datasets = [s for s in args.datasets.split(",") if s]
    for ds in datasets:
        if ds not in DATASETS:
            p.error(f"unknown data set {ds!r}; choose from {DATASETS}")
    d, batch = args.head_dim, args.batch
    load_start = os.getloadavg()
    t_start = time.time()
    lines: list[str] = []
    out = lines.append

    tmp = Path(tempfile.mkdtemp(prefix="tkv-bench-"))
    peer = None
    if not args.no_peer:
        py = ensure_peer_venv(args.peer_venv, torch.__version__.split("+")[0])
        spec = {"batch": batch, "head_dim": d, "seed": args.seed, "n_outlier": args.n_outlier,
                "outlier_scale": args.outlier_scale, "warmup": args.warmup,
                "threads": args.threads, "err_dir": str(tmp)}
        print(f"[peer] starting {PEER_DIST}=={PEER_VERSION} worker in {py}", file=sys.stderr)
        peer = PeerProcess(py, spec, tmp)
        if peer.info["torch"] != torch.__version__:
            print(f"[peer] WARNING: peer torch {peer.info['torch']} != ours {torch.__version__}",
                  file=sys.stderr)

    rows = []  # dicts: dataset, method, bits, stats
    errs: dict[tuple[str, str, int], torch.Tensor] = {}
    try:
        for ds in datasets:
            x = make_inputs(ds, batch, d, args.seed, args.n_outlier, args.outlier_scale)
            cs = checksum(x)
            for bits in bits_list:
                print(f"[bench] {ds} K{bits}", file=sys.stderr)
                ours = TurboKVCodec(d, bits, device="cpu", check_finite=False)
                beta = TurboKVCodec(d, bits, device="cpu", check_finite=False, k_codebook="beta")
                base = AsymIntBaseline(bits, d)
                methods = {
                    "ours": ("ours (tkv.codec)",
                             LocalMethod(ours.compress_k, ours.decompress_k, x, args.warmup)),
                    "beta": ("ours, k_codebook='beta'",
                             LocalMethod(beta.compress_k, beta.decompress_k, x, args.warmup)),
                }
                if peer is not None:
                    pm = PeerMethod(peer, ds, bits)
                    if pm.prepared["checksum"] != cs:
                        raise RuntimeError(f"peer saw different inputs for {ds} (checksum)")
                    methods["peer"] = (f"turbo-attn {PEER_VERSION}", pm)
                methods["int"] = (f"int{bits}-asym per-token",
                                  LocalMethod(base.compress, base.decompress, x, args.warmup))
                # Interleave: each repeat times every method once, in a rotating order, so load
                # changes on the shared machine hit all methods alike.
                keys = list(methods)
                times: dict[str, list] = {k: [] for k in keys}
                for r in range(args.repeats):
                    for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                        times[k].append(methods[k][1].time_once())
                for k in keys:
                    q, e = methods[k][1].quality()
                    rows.append({"dataset": ds, "method": methods[k][0], "bits": bits, **q,
                                 **summarize(times[k])})
                    errs[(ds, k, bits)] = e
                layout_bytes = ours.layout(num_kv_heads=1, block_size=16).k_slot_bytes
                got = next(r for r in rows if r["method"].startswith("ours (")
                           and r["dataset"] == ds and r["bits"] == bits)["bytes_per_vector"]
                if got != layout_bytes:
                    raise RuntimeError(f"ours: payload {got} B/vector != SlotLayout "
                                       f"k_slot_bytes {layout_bytes}")
    finally:
        if peer is not None:
            peer.close()

    prof_rows = top_ops = proto_rows = None
    if not args.no_profile:
        print("[profile] ours ...", file=sys.stderr)
        xg = make_inputs("gaussian", batch, d, args.seed, args.n_outlier, args.outlier_scale)
        prof_rows = profile_ours(xg, bits_list, args.warmup, args.repeats)
        top_ops = profiler_top_ops(xg, 4 if 4 in bits_list else bits_list[0])
        proto_rows = prototypes(xg, bits_list, args.warmup, args.repeats)
    load_end = os.getloadavg()

    # ---- markdown
    out(f"### codec_cpu run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    out("")
    out(f"- command: `{' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}`")
    out(f"- machine: {_cpu_model()}, {os.cpu_count()} logical CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}; "
        f"**torch.set_num_threads({args.threads})**; repo commit {_git_commit()}")
    out(f"- batch {batch} vectors × head_dim {d} float32, seed {args.seed}; warmup {args.warmup}, "
        f"median of {args.repeats} repeats, methods interleaved per repeat (rotating order); "
        f"wall time {time.time() - t_start:.0f} s")
    out(f"- load average (1/5/15 min) at start {load_start[0]:.2f}/{load_start[1]:.2f}/"
        f"{load_start[2]:.2f}, at end {load_end[0]:.2f}/{load_end[1]:.2f}/{load_end[2]:.2f} "
        "(shared machine: other jobs run concurrently, timings are noisy)")
    if peer is not None:
        pr0 = next(r for r in rows if r["method"].startswith("turbo-attn"))
        out(f"- peer: {PEER_DIST}=={peer.info['version']} (`{peer.info['module']}`), torch "
            f"{peer.info['torch']}, norms {pr0['norm_dtype']}, K norm correction "
            f"{pr0['k_norm_correction']}, declared bytes/vector "
            f"{sorted({r['declared_bytes_per_vector'] for r in rows if 'declared_bytes_per_vector' in r})}"
            "; inputs checksum-identical; timed calls interleaved with ours in one process each")
    out("- `outlier`: N(0,1) with "
        f"{args.n_outlier} fixed channels ×{args.outlier_scale:g}")
    out("")
    out("| data | method | bits | B/vec | bits/elem | compress Mvec/s | decompress Mvec/s "
        "| round-trip Mvec/s | rt spread | rel. MSE | MSE ÷ ours | round-trip ÷ ours |")
    out("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ours = next(o for o in rows if o["dataset"] == r["dataset"] and o["bits"] == r["bits"]
                    and o["method"].startswith("ours"))
        bpv = r["bytes_per_vector"]
        out(f"| {r['dataset']} | {r['method']} | {r['bits']} | {bpv:g} | {8 * bpv / d:.3f} "
            f"| {_mvs(batch, r['compress_s'])} | {_mvs(batch, r['decompress_s'])} "
            f"| {_mvs(batch, r['roundtrip_s'])} | ±{50 * r['roundtrip_spread']:.0f}% "
            f"| {r['rel_mse']:.4e} | {r['rel_mse'] / ours['rel_mse']:.3f} "
            f"| {ours['roundtrip_s'] / r['roundtrip_s']:.2f} |")
    out("")
    out("Ratios are against `ours` (tkv.codec.TurboKVCodec) at the same bit width: MSE ÷ ours > 1 "
        "means the method is less accurate than ours; round-trip ÷ ours > 1 means it is faster. "
        "B/vec counts every stored byte per vector (codes + bf16 norm, or codes + fp16 scale + "
        "fp16 zero). rt spread = (max − min) / 2 / median of the round-trip repeats.")
    out("")
    out("Paired MSE difference on the same vectors (method − reference; mean of per-vector "
        "‖x−x̂‖²/‖x‖², 95 % CI = ±1.96 standard errors of the paired difference):")
    out("")
    out("| data | bits | reference | method | rel. MSE: method − reference | 95 % CI "
        "| reference better? |")
    out("|---|---:|---|---|---:|---:|---|")
    names = {"ours": "ours", "beta": "ours, beta codebook", "peer": f"turbo-attn {PEER_VERSION}"}
    pairs = (("ours", "peer"), ("ours", "int"), ("beta", "peer"), ("ours", "beta"))
    for ds in datasets:
        for bits in bits_list:
            for ref, key in pairs:
                if (ds, key, bits) not in errs:
                    continue
                diff = errs[(ds, key, bits)] - errs[(ds, ref, bits)]
                mean = float(diff.mean())
                ci = 1.96 * float(diff.std()) / math.sqrt(diff.numel())
                verdict = "yes" if mean - ci > 0 else ("no (worse)" if mean + ci < 0 else "tie")
                out(f"| {ds} | {bits} | {names[ref]} | {names.get(key, f'int{bits}-asym')} "
                    f"| {mean:+.3e} | ±{ci:.1e} | {verdict} |")
    if prof_rows is not None:
        out("")
        out(f"Profile of ours (`gaussian`, ms per {batch} vectors, median of {args.repeats}; "
            "each step timed alone, so steps need not sum to the end-to-end time):")
        out("")
        steps = list(dict.fromkeys(r["step"] for r in prof_rows))
        out("| step | " + " | ".join(f"K{b} ms" for b in bits_list) + " |")
        out("|---|" + "---:|" * len(bits_list))
        for s in steps:
            vals = [next(r["ms"] for r in prof_rows if r["step"] == s and r["bits"] == b)
                    for b in bits_list]
            out(f"| {s} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
        out("")
        out("Top aten ops (torch.profiler, self CPU ms, one call, K"
            f"{4 if 4 in bits_list else bits_list[0]}):")
        out("")
        out("| phase | op | self ms |")
        out("|---|---|---:|")
        for phase, key, ms in top_ops:
            out(f"| {phase} | `{key}` | {ms:.1f} |")
        out("")
        out("Bit-exact prototypes of faster steps (checked with torch.equal against the codec's "
            "step; not used by the codec):")
        out("")
        out("| bits | step | current | ms | prototype | ms | speed-up |")
        out("|---|---|---|---:|---|---:|---:|")
        for r in proto_rows:
            out(f"| {r['bits']} | {r['step']} | {r['current']} | {r['cur_ms']:.1f} | {r['proto']} "
                f"| {r['proto_ms']:.1f} | {r['cur_ms'] / r['proto_ms']:.1f}× |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        args.output.write_text(report)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
