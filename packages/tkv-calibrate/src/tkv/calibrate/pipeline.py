"""The main job: calibrate → sensitivity → SmartMix (verified) → bundle → evaluate → report.

:class:`JobConfig` holds every knob (the CLI maps flags onto it); :func:`run_job` runs the
job and returns a :class:`JobResult`. The default job (budgets 3.0/4.0/5.0, 8 evaluation
windows of 1,024 tokens, no peers, no needle) is sized for ≤ 10 minutes on a 2-core CPU with
SmolLM2-135M; ``full=True`` runs every budget of the grid, every peer on 16 windows, and the
needle test.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tkv.codec import CalibrationBundle, LayerAllocation, ModelGeometry, ModelLayout
from tkv.codec.errors import TkvBitsError
from tkv.codec.validation import check_seed

from .calibrate import Calibration, draft_bundle, fit_calibration
from .collect import window_sink_tokens
from .data import default_calib_text, default_eval_text, tokenize_windows
from .errors import JobConfigError
from .evaluate import Arm, EvalResult, evaluate_arms, measure_kl
from .fitting import MIN_FITTED_GAIN
from .model import LoadedModel, load_model
from .peers import bf16_bytes_per_token_head, peer_arms, uncalibrated_arm
from .quantizers import PRICE_BLOCK_SIZE, TkvQuantizer
from .scales import center_mode
from .sensitivity import Sensitivity, measure_sensitivity
from .smartmix import (
    DEFAULT_BUDGETS,
    WIDTHS,
    allocation_bytes,
    budget_cap_bytes,
    check_budget,
    check_widths,
    predicted_drift,
    solve_mix,
    uniform_candidates,
)

__all__ = ["BudgetDecision", "JobConfig", "JobResult", "run_job", "tkv_arm"]

TOOL_VERSION = "0.1.0"
DEFAULT_JOB_BUDGETS = (3.0, 4.0, 5.0)


@dataclass
class JobConfig:
    """Settings of one calibration job (see the CLI for the flags)."""

    model: str | None = None
    calib_text: str | None = None
    eval_text: str | None = None
    out: str = "tkv-calibration"
    budgets: tuple[float, ...] = DEFAULT_JOB_BUDGETS
    full: bool = False
    calib_window: int = 512
    collect_windows: int = 8
    sensitivity_windows: int = 1
    verify_windows: int = 2
    eval_window: int = 1024
    eval_windows: int = 8
    probe_bits: int = 3
    peers: bool = False
    needle: bool = False
    decode: bool = True
    center_keys: bool | str = "per-head"  # "per-head" | "shared" | "off" (True/False accepted)
    codebook_min_gain: float = MIN_FITTED_GAIN  # a fit ships only above this held-out MSE gain
    sink_offset: bool = True    # per-layer sink offsets (flagged by the norm's sign bit)
    mix_widths: tuple[int, ...] = WIDTHS  # widths SmartMix (and the uniform rows) may use
    seed: int = 0
    threads: int | None = None
    show_progress: bool = True

    @classmethod
    def full_report(cls, **kw) -> JobConfig:
        """Every budget of the grid, every peer, 16 evaluation windows, needle test."""
        base = dict(budgets=DEFAULT_BUDGETS, full=True, eval_windows=16, sensitivity_windows=2,
                    verify_windows=3, peers=True, needle=True)
        base.update(kw)
        return cls(**base)

    def validate(self) -> None:
        """The CLI's argument rules, for callers that build the config themselves.

        Raises:
            TkvBitsError: no budget, a budget outside [2, 8], or bad ``mix_widths``.
            JobConfigError: a window count < 1 (tokens per calibration window < 2), probe
                bits outside 2..7, an unknown ``center_keys``, ``codebook_min_gain`` outside
                [0, 1), ``threads`` < 1, or a seed that is not an int in [0, 2**64);
                ``out`` naming an existing file."""
        if not self.budgets:   # draft_bundle would fill in a K4V4 row nobody asked for
            raise TkvBitsError("at least one budget is needed, e.g. (3.0, 4.0, 5.0)")
        self.budgets = tuple(sorted({check_budget(b) for b in self.budgets}))
        self.mix_widths = check_widths(self.mix_widths)
        for name, lo in (("calib_window", 2), ("collect_windows", 1), ("sensitivity_windows", 1),
                         ("verify_windows", 1), ("eval_window", 2), ("eval_windows", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise JobConfigError(f"{name} must be an int >= {lo}, got {v!r}")
        if not 2 <= self.probe_bits <= 7:
            raise JobConfigError(f"probe_bits must be in 2..7, got {self.probe_bits!r}")
        if self.center_keys not in (True, False, "per-head", "shared", "off"):
            raise JobConfigError(f"center_keys must be 'per-head', 'shared' or 'off' (or a "
                                 f"bool), got {self.center_keys!r}")
        g = self.codebook_min_gain
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < 1:
            raise JobConfigError(f"codebook_min_gain must be a fraction in [0, 1), got {g!r}")
        if self.threads is not None and (isinstance(self.threads, bool)
                                         or not isinstance(self.threads, int) or self.threads < 1):
            raise JobConfigError(f"threads must be None or an int >= 1, got {self.threads!r}")
        try:
            check_seed(self.seed)
        except ValueError as e:
            raise JobConfigError(str(e)) from None
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise JobConfigError(f"out {self.out!r} is an existing file, not a folder")


@dataclass
class BudgetDecision:
    """SmartMix outcome of one budget, verified on held-out calibration text."""

    budget: float
    cap_bytes: float
    mix: LayerAllocation
    mix_bytes: float
    mix_predicted_kl: float
    mix_measured_kl: float
    uniform: tuple[int, int]
    uniform_bytes: float
    uniform_predicted_kl: float
    uniform_measured_kl: float
    uniform_tried: list[tuple[int, int, float]]
    chosen: LayerAllocation

    def to_dict(self) -> dict:
        return {
            "budget": self.budget, "cap_bytes_per_token": self.cap_bytes,
            "mix_k_bits": list(self.mix.k_bits), "mix_v_bits": list(self.mix.v_bits),
            "mix_bytes_per_token": self.mix_bytes, "mix_predicted_kl": self.mix_predicted_kl,
            "mix_heldout_kl": self.mix_measured_kl,
            "best_uniform": f"K{self.uniform[0]}V{self.uniform[1]}",
            "best_uniform_bytes_per_token": self.uniform_bytes,
            "best_uniform_predicted_kl": self.uniform_predicted_kl,
            "best_uniform_heldout_kl": self.uniform_measured_kl,
            "uniform_tried": [{"k_bits": k, "v_bits": v, "heldout_kl": m}
                              for k, v, m in self.uniform_tried],
            "shipped": self.chosen.source,
        }


@dataclass
class JobResult:
    """Everything the report needs."""

    config: JobConfig
    model_name: str
    geometry: ModelGeometry
    calibration: Calibration
    sensitivity: Sensitivity
    decisions: list[BudgetDecision]
    bundle_path: Path
    evaluation: EvalResult | None
    needle: dict | None
    timings: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)

    @property
    def bf16_bytes(self) -> float:
        return bf16_bytes_per_token_head(self.geometry.head_dim)


def tkv_arm(bundle: CalibrationBundle, alloc: LayerAllocation, name: str, group: str,
            meta: dict | None = None) -> Arm:
    """An evaluation arm reading ``bundle``'s calibrated codecs at ``alloc``'s widths; bytes
    per token per KV head from :class:`tkv.codec.ModelLayout`."""
    g = bundle.geometry
    qs = [TkvQuantizer(bundle.codec(i, kb, vb, check_finite=False))
          for i, (kb, vb) in enumerate(zip(alloc.k_bits, alloc.v_bits, strict=True))]
    lay = ModelLayout.from_allocation(g.head_dim, g.num_kv_heads, alloc.k_bits, alloc.v_bits,
                                      PRICE_BLOCK_SIZE)
    per_head = lay.bytes_per_token / (g.num_layers * g.num_kv_heads)
    m = {"k_bits": list(alloc.k_bits), "v_bits": list(alloc.v_bits),
         "bits_per_element": round(alloc.bits_per_element(g.head_dim), 4)}
    m.update(meta or {})
    return Arm(name, qs, per_head, group, m)


def _uniform_alloc(n: int, kb: int, vb: int) -> LayerAllocation:
    return LayerAllocation.uniform(n, kb, vb, "uniform")


def _describe(alloc: LayerAllocation) -> str:
    pairs = list(zip(alloc.k_bits, alloc.v_bits, strict=True))
    if len(set(pairs)) == 1:
        return f"K{pairs[0][0]}V{pairs[0][1]}"
    ks, vs = sum(alloc.k_bits) / len(pairs), sum(alloc.v_bits) / len(pairs)
    return f"mix K~{ks:.2f} V~{vs:.2f}"


def decide_budgets(model, bundle: CalibrationBundle, sens: Sensitivity, budgets,
                   verify: torch.Tensor, show_progress: bool = True,
                   uniform_tries: int = 2, widths=WIDTHS) -> list[BudgetDecision]:
    """Solve SmartMix per budget and verify it against the best uniform allocation that fits
    the same byte cap, on held-out calibration windows ``verify``; ship the mix only if its
    measured KL is lower."""
    geo = bundle.geometry
    n = geo.num_layers
    pred = sens.table()
    plans, sets, index = [], [], {}

    def want(alloc: LayerAllocation) -> int:
        key = (alloc.k_bits, alloc.v_bits)
        if key not in index:
            index[key] = len(sets)
            sets.append([TkvQuantizer(bundle.codec(i, kb, vb, check_finite=False))
                         for i, (kb, vb) in enumerate(zip(alloc.k_bits, alloc.v_bits, strict=True))])
        return index[key]

    for b in budgets:
        cap = budget_cap_bytes(geo, b)
        plan = solve_mix(pred, geo, cap, widths)
        cands = sorted(uniform_candidates(geo, cap, widths),
                       key=lambda kv: predicted_drift(pred, (kv[0],) * n, (kv[1],) * n))
        # Always try the plain K=V uniform at floor(budget) too, and the top predicted ones.
        lo = int(b)
        tries = cands[:uniform_tries]
        if (lo, lo) in cands and (lo, lo) not in tries:
            tries.append((lo, lo))
        plans.append((b, cap, plan, tries, want(plan.allocation),
                      [want(_uniform_alloc(n, kb, vb)) for kb, vb in tries]))
    kls = measure_kl(model, verify, sets, show_progress, "verify SmartMix")
    out = []
    for b, cap, plan, tries, mi, uis in plans:
        tried = [(kb, vb, kls[ui]) for (kb, vb), ui in zip(tries, uis, strict=True)]
        kb, vb, ukl = min(tried, key=lambda t: t[2])
        ualloc = _uniform_alloc(n, kb, vb)
        mkl = kls[mi]
        is_uniform = len(set(zip(plan.allocation.k_bits, plan.allocation.v_bits, strict=True))) == 1
        if mkl < ukl and not is_uniform:
            chosen = plan.allocation
        else:
            chosen = ualloc if ukl <= mkl else LayerAllocation(plan.allocation.k_bits,
                                                               plan.allocation.v_bits, "uniform")
        out.append(BudgetDecision(
            b, cap, plan.allocation, plan.bytes_per_token, plan.predicted_kl, mkl, (kb, vb),
            allocation_bytes(geo, ualloc), predicted_drift(pred, ualloc.k_bits, ualloc.v_bits),
            ukl, tried, chosen))
    return out


def run_job(cfg: JobConfig, loaded: LoadedModel | None = None) -> JobResult:
    """Run the whole job (module docstring). ``loaded`` skips model loading (tests).

    Raises:
        ModelNotFoundError, UnsupportedModelError, TextTooShortError, TextEncodingError,
        TkvBitsError, JobConfigError (:meth:`JobConfig.validate`, before the model loads).
    """
    from .report import write_report

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    times: dict[str, float] = {}
    t_start = time.perf_counter()
    t = time.perf_counter()
    lm = loaded or load_model(cfg.model)
    times["load_model"] = time.perf_counter() - t
    geo = lm.geometry
    low = min(cfg.mix_widths)
    for b in cfg.budgets:   # before minutes of collection: every budget must fit some mix
        # (uniform K{low}V{low} is the cheapest allocation: no uniform fits ⇔ no mix fits)
        if not uniform_candidates(geo, budget_cap_bytes(geo, b), cfg.mix_widths):
            raise TkvBitsError(f"TKV_BITS={b:g} cannot be met with SmartMix widths "
                               f"{list(cfg.mix_widths)}: even K{low}V{low} everywhere exceeds "
                               "its bytes; add a narrower width or drop the budget")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    calib_path = cfg.calib_text or str(default_calib_text())
    eval_path = cfg.eval_text or str(default_eval_text())
    n_cal = cfg.collect_windows + cfg.sensitivity_windows + cfg.verify_windows
    cal_w = tokenize_windows(lm.tokenizer, calib_path, cfg.calib_window, n_cal)
    ev_w = tokenize_windows(lm.tokenizer, eval_path, cfg.eval_window, cfg.eval_windows)
    collect_ids = cal_w.subset(0, cfg.collect_windows)
    sens_ids = cal_w.subset(cfg.collect_windows, cfg.sensitivity_windows)
    verify_ids = cal_w.subset(cfg.collect_windows + cfg.sensitivity_windows, cfg.verify_windows)
    eval_ids = ev_w.subset(0, cfg.eval_windows)
    times["tokenize"] = time.perf_counter() - t

    t = time.perf_counter()
    cal = fit_calibration(lm.model, geo, collect_ids, cfg.seed, show_progress=cfg.show_progress,
                          center_keys=cfg.center_keys,
                          codebook_min_gain=cfg.codebook_min_gain,
                          sink_tokens=window_sink_tokens(collect_ids) if cfg.sink_offset
                          else None)
    times["collect"] = cal.seconds["collect"]
    times["scales_codebooks"] = cal.seconds["fit"]
    draft = draft_bundle(cal)

    t = time.perf_counter()
    sens = measure_sensitivity(lm.model, sens_ids, draft, cal.distortion, cfg.probe_bits,
                               seed=cfg.seed, show_progress=cfg.show_progress)
    times["sensitivity"] = time.perf_counter() - t

    t = time.perf_counter()
    decisions = decide_budgets(lm.model, draft, sens, cfg.budgets, verify_ids, cfg.show_progress,
                               widths=cfg.mix_widths)
    times["smartmix_verify"] = time.perf_counter() - t

    prov = {
        "tool": "tkv-calibrate", "tool_version": TOOL_VERSION, "model": lm.name,
        "model_path": lm.path, "corpus": Path(calib_path).name, "corpus_path": calib_path,
        "corpus_sha256": cal_w.sha256,
        "num_tokens": int(collect_ids.numel()),
        "sensitivity_tokens": int(sens_ids.numel()), "verify_tokens": int(verify_ids.numel()),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "key_centering": center_mode(cfg.center_keys),
        "sink_offset": bool(cfg.sink_offset),
        "mix_widths": list(cfg.mix_widths),
        "budget_semantics": "TKV_BITS=b buys the bytes of a uniform cache with b-bit K and V "
                            "codes plus bf16 norms (interpolated between floor(b) and ceil(b)), "
                            "priced by tkv.codec.layout",
    }
    metrics = {
        "calibration": cal.summary(),
        "sensitivity": {"probe_bits": sens.probe_bits, "gamma": sens.gamma, **sens.correlation()},
        "smartmix": {f"{d.budget:.1f}": d.to_dict() for d in decisions},
    }
    table = {repr(d.budget): d.chosen for d in decisions}
    bundle_path = out / "tkv_bundle.json"
    bundle = draft_bundle(cal, table, prov, metrics)
    bundle.save(bundle_path)
    bundle = CalibrationBundle.load(bundle_path)  # what we evaluate is what we ship

    evaluation = None
    if cfg.eval_windows:
        t = time.perf_counter()
        arms = []
        n = geo.num_layers
        for d in decisions:
            u = _uniform_alloc(n, *d.uniform)
            arms.append(tkv_arm(bundle, u, f"TKV@{d.budget:g} uniform K{d.uniform[0]}V{d.uniform[1]}",
                                "tkv", {"budget": d.budget}))
            if d.chosen.source == "smartmix":
                arms.append(tkv_arm(bundle, d.chosen, f"TKV@{d.budget:g} SmartMix", "smartmix",
                                    {"budget": d.budget}))
            elif d.mix != d.chosen:
                # Report the rejected mix too, so the verification decision is visible.
                arms.append(tkv_arm(bundle, d.mix, f"TKV@{d.budget:g} SmartMix (rejected)",
                                    "smartmix-rejected", {"budget": d.budget}))
        if cfg.peers:
            arms += peer_arms(n, geo.head_dim, cfg.seed)
            arms += [uncalibrated_arm(n, geo.head_dim, b, cfg.seed) for b in (3, 4, 5)]
        evaluation = evaluate_arms(lm.model, eval_ids, arms, decode=cfg.decode,
                                   show_progress=cfg.show_progress, desc="evaluate (test)")
        times["evaluate"] = time.perf_counter() - t

    needle = None
    if cfg.needle:
        from .needle import NeedleConfig, run_needle

        t = time.perf_counter()
        needle = run_needle(lm, bundle, NeedleConfig(seed=cfg.seed), show_progress=cfg.show_progress)
        times["needle"] = time.perf_counter() - t

    times["total"] = time.perf_counter() - t_start
    res = JobResult(cfg, lm.name, geo, cal, sens, decisions, bundle_path, evaluation, needle,
                    times, prov)
    if evaluation is not None:
        m = dict(bundle.metrics)
        m["evaluation"] = {"text": Path(eval_path).name, "windows": evaluation.windows,
                           "window": evaluation.window, "decode_prefix": evaluation.prefix,
                           "baseline_ppl": evaluation.base.ppl,
                           "rows": evaluation.rows(res.bf16_bytes)}
        if needle is not None:
            m["needle"] = needle["summary"]
        m["timings_s"] = {k: round(v, 1) for k, v in times.items()}
        CalibrationBundle(bundle.geometry, bundle.layers, bundle.byte_budget_table,
                          bundle.provenance, m, bundle.seed).save(bundle_path)
        CalibrationBundle.load(bundle_path)
    write_report(res, out)
    (out / "metrics.json").write_text(json.dumps(_jsonable(res), indent=1) + "\n")
    return res


def _jsonable(res: JobResult) -> dict:
    d = {
        "model": res.model_name, "geometry": res.geometry.to_dict(),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(res.config).items()},
        "calibration": res.calibration.summary(),
        "sensitivity": {"probe_bits": res.sensitivity.probe_bits, "gamma": res.sensitivity.gamma,
                        "probe_kl": res.sensitivity.probe, **res.sensitivity.correlation(),
                        "validation": [list(v) for v in res.sensitivity.validation]},
        "smartmix": [x.to_dict() for x in res.decisions],
        "timings_s": res.timings, "provenance": res.provenance,
        "bundle": str(res.bundle_path),
    }
    if res.evaluation is not None:
        d["evaluation"] = {"baseline_ppl": res.evaluation.base.ppl,
                           "windows": res.evaluation.windows, "window": res.evaluation.window,
                           "decode_prefix": res.evaluation.prefix,
                           "rows": res.evaluation.rows(res.bf16_bytes)}
    if res.needle is not None:
        d["needle"] = res.needle
    return d


def _bundle_arms(bundle: CalibrationBundle, budgets=None) -> list[Arm]:
    """The bundle's shipped rows, plus each row's best uniform (from its SmartMix metrics)."""
    n = bundle.geometry.num_layers
    arms = []
    sm = bundle.metrics.get("smartmix", {}) if isinstance(bundle.metrics, dict) else {}
    keys = bundle.budgets() if budgets is None else [repr(check_budget(b)) for b in budgets]
    for key in keys:
        b = float(key)
        alloc = bundle.allocation(key)
        info = sm.get(f"{b:.1f}", {})
        bu = info.get("best_uniform")
        if alloc.source == "smartmix":
            arms.append(tkv_arm(bundle, alloc, f"TKV@{b:g} SmartMix", "smartmix", {"budget": b}))
        else:
            arms.append(tkv_arm(bundle, alloc, f"TKV@{b:g} uniform {_describe(alloc)}", "tkv",
                                {"budget": b}))
        if bu and alloc.source == "smartmix":
            kb, vb = (int(x) for x in bu[1:].split("V"))
            arms.append(tkv_arm(bundle, _uniform_alloc(n, kb, vb), f"TKV@{b:g} uniform {bu}",
                                "tkv", {"budget": b}))
    return arms


def evaluate_bundle(bundle_path: str, out: str = "tkv-calibration", model: str | None = None,
                    eval_text: str | None = None, eval_windows: int = 8, eval_window: int = 1024,
                    budgets=None, peers: bool = True, decode: bool = True, seed: int = 0,
                    show_progress: bool = True, loaded: LoadedModel | None = None) -> dict:
    """Evaluate an existing bundle's rows beside peers and uncalibrated TurboQuant on the
    evaluation text; writes ``out/evaluation.md``, ``evaluation.png``, ``evaluation.json``.

    Raises:
        FileNotFoundError, BundleSchemaError, BundleGeometryError, TextTooShortError.
    """
    from .report import evaluation_lines, goal_lines, machine_note, plot_rows, table_rows

    t0 = time.perf_counter()
    bundle = CalibrationBundle.load(bundle_path)
    lm = loaded or load_model(model)
    g = lm.geometry
    bundle.check_geometry(g.num_layers, g.num_kv_heads, g.head_dim)
    eval_path = eval_text or str(default_eval_text())
    ids = tokenize_windows(lm.tokenizer, eval_path, eval_window, eval_windows).subset(0, eval_windows)
    arms = _bundle_arms(bundle, budgets)
    if peers:
        arms += peer_arms(g.num_layers, g.head_dim, seed)
        arms += [uncalibrated_arm(g.num_layers, g.head_dim, b, seed) for b in (3, 4, 5)]
    ev = evaluate_arms(lm.model, ids, arms, decode=decode, show_progress=show_progress,
                       desc="evaluate (test)")
    bf16 = bf16_bytes_per_token_head(g.head_dim)
    rows = table_rows(ev, lm.name, bf16)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    secs = time.perf_counter() - t0
    md = [f"# tkv evaluation — {lm.name}, bundle `{Path(bundle_path).name}`\n",
          *evaluation_lines(ev, rows), *goal_lines(rows, windows=(ev.windows, ev.window)),
          f"Wall time: {secs:.0f} s ({machine_note()}).\n"]
    (o / "evaluation.md").write_text("\n".join(md) + "\n")
    plot_rows(rows, lm.name, o / "evaluation.png")
    res = {"model": lm.name, "bundle": str(bundle_path), "windows": ev.windows,
           "window": ev.window, "decode_prefix": ev.prefix, "baseline_ppl": ev.base.ppl,
           "rows": rows, "seconds": secs}
    (o / "evaluation.json").write_text(json.dumps(res, indent=1) + "\n")
    return res
