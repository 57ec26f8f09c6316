"""Step 6: ``report.md`` + ``report.png`` (matplotlib) and the stdout summary table (rich)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["machine_note", "print_summary", "write_report"]


def machine_note() -> str:
    """Where the wall-clock times were taken: logical CPUs and the 1-minute load average at
    the time of writing (timings on a shared box are not comparable to an idle one)."""
    try:
        load = f", load average {os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):   # not on every platform
        load = ""
    return f"{os.cpu_count()} logical CPUs{load}"


def _fmt_kl(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.4f}" if x >= 1e-3 else f"{x:.2e}"


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def table_rows(ev, model_name: str, bf16_bytes: float) -> list[dict]:
    """Baseline row + one row per arm, most bytes first."""
    base = {"name": f"uncompressed ({model_name}, fp32 compute; bf16 cache bytes)",
            "group": "baseline", "bytes_per_token_head": bf16_bytes, "capacity_vs_bf16": 1.0,
            "ppl": ev.base.ppl, "delta_ppl_pct": 0.0, "kl": 0.0, "top1": 1.0,
            "decode_kl": 0.0, "decode_top1": 1.0}
    return [base, *sorted(ev.rows(bf16_bytes), key=lambda r: (-r["bytes_per_token_head"], r["name"]))]


def _rows(res) -> list[dict]:
    if res.evaluation is None:
        return []
    return table_rows(res.evaluation, res.model_name, res.bf16_bytes)


def evaluation_lines(ev, rows) -> list[str]:
    """Markdown lines describing an evaluation and its table (``rows`` from :func:`table_rows`)."""
    L = [f"Evaluation text: the first {ev.windows} windows of {ev.window} tokens of the "
         f"test split ({ev.windows * ev.window} tokens), never used for calibration. "
         f"Teacher-forced: every attention reads the quantize-dequantized cache "
         f"(prefill compressed). Decode path: first {ev.prefix} tokens of each window "
         f"prefilled uncompressed and stored compressed, the remaining "
         f"{ev.window - ev.prefix} decoded teacher-forced reading the compressed cache. "
         f"KL = mean KL(uncompressed ‖ compressed) of next-token distributions, nats.\n",
         f"Baseline perplexity: **{ev.base.ppl:.3f}**.\n",
         "| format | B/tok/head | capacity vs bf16 | PPL | ΔPPL | mean KL | top-1 | "
         "decode KL | decode top-1 |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        L.append(f"| {r['name']} | {r['bytes_per_token_head']:.1f} | "
                 f"{r['capacity_vs_bf16']:.2f}× | {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f} % | "
                 f"{_fmt_kl(r['kl'])} | {100 * r['top1']:.1f} % | {_fmt_kl(r['decode_kl'])} | "
                 f"{_fmt_pct(r['decode_top1'])} |")
    L.append("\nB/tok/head = K+V bytes per token per KV head averaged over all layers "
             "(tkv: priced by `tkv.codec.layout`, codes + bf16 norms; vLLM presets: their "
             "slot formula, boundary layers at bf16; KIVI: codes + fp16 scale/zero per group).\n")
    return L


# Goals of the tkv-calibrate issue for SmolLM2-135M (16 × 1,024 test tokens, teacher-forced):
# budget → (max KL, max ΔPPL %), and SmartMix KL ≤ 0.8 × best uniform at 4.0.
GOALS = {3.0: (None, 8.0), 4.0: (0.0153, 1.08), 5.0: (0.0071, None)}
MIX_GOAL = 0.8
GOAL_TOKENS = (16, 1024)   # the goals' reference evaluation: windows × tokens of test
VLLM_4BIT_RATIO = 0.5      # TKV@4 KL ≤ 0.5 × vLLM turboquant_4bit_nc
BYTES_VS_PEER = {4.0: ("KIVI int4", 0.85), 5.0: ("fp8-e4m3", 2 / 3)}  # bytes ≤ f × peer's


def _passes(s: str) -> tuple[int, int]:
    a, b = s.split("/")
    return int(a), int(b)


def goal_lines(rows, needle: dict | None = None,
               windows: tuple[int, int] | None = None) -> list[str]:
    """Markdown lines checking the shipped row of each budget against :data:`GOALS`, the
    byte goals and the vLLM ratio (when peers were evaluated) and the needle goals (when
    ``needle``, :func:`tkv.calibrate.needle.run_needle`'s result, is given). ``windows``:
    the evaluation's ``(windows, tokens per window)``; when it is not the goals' reference
    (:data:`GOAL_TOKENS`) a note under the table says so."""
    by_budget: dict[float, dict] = {}
    uni: dict[float, dict] = {}
    peers = {r["name"]: r for r in rows if r["group"] == "peer"}
    for r in rows:
        b = r.get("budget")
        if b is None:
            continue
        if r["group"] == "smartmix":
            by_budget[b] = r
        elif r["group"] == "tkv":
            uni[b] = r
            by_budget.setdefault(b, r)
    L = ["## Goals (issue reference for SmolLM2-135M; measured here, not tuned on test)\n",
         "| budget | shipped row | goal | measured | met? |", "|---:|---|---|---|---|"]
    for b, (kl_max, ppl_max) in GOALS.items():
        r = by_budget.get(b)
        if r is None:
            continue
        if kl_max is not None:
            verdict = "yes" if r["kl"] <= kl_max else f"no ({r['kl'] / kl_max:.2f}× the goal)"
            L.append(f"| {b:g} | {r['name']} | KL ≤ {kl_max} | {_fmt_kl(r['kl'])} | {verdict} |")
        if ppl_max is not None:
            d = r["delta_ppl_pct"]
            verdict = "yes" if d <= ppl_max else f"no (+{d - ppl_max:.2f} points over)"
            L.append(f"| {b:g} | {r['name']} | ΔPPL ≤ +{ppl_max} % | {d:+.2f} % | {verdict} |")
    if 4.0 in uni:
        # the shipped 4.0 row against the uniform one; a mix rejected on held-out text ships
        # the uniform row itself (ratio 1), so the goal shows as missed rather than vanishing
        shipped = by_budget[4.0]
        ratio = shipped["kl"] / max(uni[4.0]["kl"], 1e-30)
        what = ("SmartMix" if shipped["group"] == "smartmix"
                else "SmartMix (mix rejected, uniform shipped)")
        L.append(f"| 4 | {what} vs {uni[4.0]['name']} | KL ratio ≤ {MIX_GOAL} | {ratio:.2f} | "
                 f"{'yes' if ratio <= MIX_GOAL else f'no (by {ratio - MIX_GOAL:.2f})'} |")
    for b, (prefix, frac) in BYTES_VS_PEER.items():
        peer = next((p for n, p in peers.items() if n.startswith(prefix)), None)
        r = by_budget.get(b)
        if peer is None or r is None:
            continue
        cap = frac * peer["bytes_per_token_head"]
        got = r["bytes_per_token_head"]
        L.append(f"| {b:g} | {r['name']} | B/tok/head ≤ {frac:.2f} × {peer['name']} "
                 f"({cap:.1f}) | {got:.1f} | "
                 f"{'yes' if got <= cap else f'no (+{got - cap:.1f} B over)'} |")
    vllm = next((p for n, p in peers.items() if "turboquant_4bit_nc" in n), None)
    if vllm is not None and 4.0 in by_budget:
        ratio = by_budget[4.0]["kl"] / max(vllm["kl"], 1e-30)
        verdict = ("yes" if ratio <= VLLM_4BIT_RATIO
                   else f"no (by {ratio - VLLM_4BIT_RATIO:.2f})")
        L.append(f"| 4 | {by_budget[4.0]['name']} vs {vllm['name']} | KL ratio ≤ "
                 f"{VLLM_4BIT_RATIO} | {ratio:.2f} | {verdict} |")
    summ = (needle or {}).get("summary", {})
    if "uncompressed" in summ:
        base, total = _passes(summ["uncompressed"])
        if "TKV@4" in summ:
            got = _passes(summ["TKV@4"])[0]
            verdict = "yes" if got >= base else f"no ({base - got} cell(s) fewer)"
            L.append(f"| 4 | needle TKV@4 | passes = uncompressed ({base}/{total}) | "
                     f"{got}/{total} | {verdict} |")
        if "TKV@3" in summ:
            got = _passes(summ["TKV@3"])[0]
            allowed = total // 12
            misses = total - got
            verdict = "yes" if misses <= allowed else f"no ({misses - allowed} miss(es) over)"
            L.append(f"| 3 | needle TKV@3 | misses ≤ {allowed} of {total} | {misses} missed | "
                     f"{verdict} |")
    if windows is not None and tuple(windows) != GOAL_TOKENS:
        L.append(f"\nThe issue's reference numbers are on {GOAL_TOKENS[0]} × {GOAL_TOKENS[1]:,} "
                 f"test tokens; this evaluation used {windows[0]} × {windows[1]:,} (`--full`, or "
                 f"`--eval-windows {GOAL_TOKENS[0]}`, measures on the reference tokens).")
    return [*L, ""]


def write_report(res, out: Path) -> tuple[Path, Path]:
    """Write ``out/report.md`` and ``out/report.png``; returns their paths."""
    out = Path(out)
    md = out / "report.md"
    png = out / "report.png"
    g = res.geometry
    rows = _rows(res)
    L = []
    L.append(f"# tkv calibration report — {res.model_name}\n")
    L.append(f"Geometry: {g.num_layers} layers, {g.num_kv_heads} KV heads, head_dim {g.head_dim}. "
             f"bf16 K+V = {res.bf16_bytes:g} B per token per KV head.  ")
    p = res.provenance
    L.append(f"Calibration text: `{p.get('corpus')}` ({p.get('num_tokens')} tokens collected, "
             f"{p.get('sensitivity_tokens')} for sensitivity, {p.get('verify_tokens')} held out "
             "for SmartMix verification). Bundle: `" + res.bundle_path.name + "`.\n")
    if res.evaluation is not None:
        L += evaluation_lines(res.evaluation, rows)
        L += goal_lines(rows, res.needle, (res.evaluation.windows, res.evaluation.window))
    L.append("## SmartMix decisions (held-out calibration text)\n")
    L.append("| budget | cap B/token (all layers) | mix | mix held-out KL | best uniform | "
             "uniform held-out KL | shipped |")
    L.append("|---:|---:|---|---:|---|---:|---|")
    for d in res.decisions:
        ks = sum(d.mix.k_bits) / len(d.mix.k_bits)
        vs = sum(d.mix.v_bits) / len(d.mix.v_bits)
        L.append(f"| {d.budget:g} | {d.cap_bytes:g} | K̄={ks:.2f} V̄={vs:.2f} ({d.mix_bytes:g} B) | "
                 f"{_fmt_kl(d.mix_measured_kl)} | K{d.uniform[0]}V{d.uniform[1]} "
                 f"({d.uniform_bytes:g} B) | {_fmt_kl(d.uniform_measured_kl)} | {d.chosen.source} |")
    L.append("\nPer-layer widths of every shipped row are in the bundle's `byte_budget_table`. "
             "A mix is shipped only where it measured lower KL than the best uniform allocation "
             "within the same byte cap.\n")
    s = res.calibration.summary()
    L.append("## Calibration\n")
    L.append(f"- Key centering and channel scales (4-bit probe, held-out tokens): key logit "
             f"relative MSE {s['k_logit_rel_mse_unscaled']:.4g} (plain) → "
             f"{s['k_logit_rel_mse_scaled_uncentered']:.4g} (scales) → "
             f"{s['k_logit_rel_mse_scaled']:.4g} (scales + centering; "
             f"{s['k_centered_layers']}/{s['num_layers']} layers centered, "
             f"{s['k_scaled_layers']}/{s['num_layers']} scaled); value output relative "
             f"MSE {s['v_output_rel_mse_unscaled']:.4g} → {s['v_output_rel_mse_scaled']:.4g} "
             f"({s['v_scaled_layers']}/{s['num_layers']} layers scaled).")
    gain = s["codebook_min_gain"]
    rule = ("any held-out gain" if gain <= 0 else
            f"a held-out MSE more than {100 * gain:g} % below the default's")
    for side in ("k", "v"):
        parts = ", ".join(
            f"{b} bit {s[f'{side}{b}_codebook_mse_gaussian']:.4g} / "
            f"{s[f'{side}{b}_codebook_mse_fit_candidate']:.4g} / "
            f"{s[f'{side}{b}_codebook_mse_fitted']:.4g} "
            f"({s[f'{side}{b}_codebooks_kept']} of {s['num_layers']} layers fitted)"
            for b in (2, 3, 4, 8))
        L.append(f"- {side.upper()} codebook MSE per coordinate (held-out), Gaussian default / "
                 f"per-layer fit / shipped: {parts}. A fit ships for {rule} "
                 "(`--codebook-min-gain`; layers sharing the default codebook get the "
                 "fastest serving lookup, `prmti`).")
    c = res.sensitivity.correlation()
    L.append(f"- Sensitivity: every layer's K and V measured alone at {res.sensitivity.probe_bits} "
             f"bits; other widths predicted as KL_probe · (D_b/D_probe)^γ, γ = "
             f"{res.sensitivity.gamma:.3f}; on a measured validation sample of {c['n']} "
             f"(layer, side, width) points, each predicted with the γ of the other points "
             f"(leave-one-out): Pearson r(log) = {c['pearson_log']:.3f}, Spearman ρ = "
             f"{c['spearman']:.3f}.")
    ks = res.sensitivity.probe["k"]
    vs = res.sensitivity.probe["v"]
    L.append(f"- Probe KL summed over layers: K {sum(ks):.4g}, V {sum(vs):.4g} (keys "
             f"{'dominate' if sum(ks) > sum(vs) else 'do not dominate'}).\n")
    if res.needle is not None:
        L.append("## Needle in a haystack\n")
        L.append(res.needle.get("markdown", ""))
    L.append(f"## Timings (s, wall clock; {machine_note()})\n")
    L.append(", ".join(f"{k} {v:.0f}" for k, v in res.timings.items()) + "\n")
    md.write_text("\n".join(L) + "\n")
    _plot(res, rows, png)
    return md, png


def _plot(res, rows, path: Path) -> None:
    plot_rows(rows, res.model_name, path)


def plot_rows(rows, model_name: str, path: Path) -> list[str]:
    """KL and ΔPPL vs bytes per token per KV head, one point per arm, a legend of the groups
    present; a label that would overprint the one above it at the same bytes (a rejected
    SmartMix mix sits on its uniform row's bytes) moves down just enough. Writes ``path``
    (PNG) and returns the legend's entries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6))
    groups = {"tkv": ("tab:blue", "uniform TKV"), "smartmix": ("tab:green", "SmartMix (shipped)"),
              "smartmix-rejected": ("tab:olive", "SmartMix (measured worse, not shipped)"),
              "peer": ("tab:red", "peer formats"), "uncalibrated": ("tab:gray", "uncalibrated")}
    pts = [r for r in rows if r["group"] != "baseline"]
    panels = ((axes[0], "kl", "mean KL vs uncompressed (nats, log)"),
              (axes[1], "delta_ppl_pct", "ΔPPL (%)"))
    ys = {key: [max(r[key], 1e-6) if key == "kl" else r[key] for r in pts]
          for _, key, _ in panels}
    seen: dict[str, object] = {}
    for ax, key, label in panels:
        for r, y in zip(pts, ys[key], strict=True):
            color, name = groups.get(r["group"], ("k", r["group"]))
            handle = ax.scatter(r["bytes_per_token_head"], y, color=color, s=30)
            seen.setdefault(name, handle)
        ax.set_xlabel("bytes per token per KV head (avg over layers)")
        ax.set_ylabel(label)
        if key == "kl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if pts:   # room on the right for the labels of the widest formats
            lo = min(r["bytes_per_token_head"] for r in pts)
            hi = max(r["bytes_per_token_head"] for r in pts)
            ax.set_xlim(lo - 0.05 * (hi - lo + 1), hi + 0.3 * (hi - lo + 1))
    if pts:
        fig.legend(list(seen.values()), list(seen), fontsize=8, loc="lower center",
                   ncol=len(seen), frameon=False)
    else:
        axes[0].text(0.5, 0.5, "no evaluation run", ha="center")
    fig.suptitle(f"tkv on {model_name}: fidelity vs cache bytes")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.canvas.draw()   # final axes sizes and limits: label offsets are computed in points
    # columns: points within a byte of their neighbour share one (labels stacked top down)
    by_x = sorted(range(len(pts)), key=lambda i: pts[i]["bytes_per_token_head"])
    columns: list[list[int]] = []
    for i in by_x:
        x = pts[i]["bytes_per_token_head"]
        if columns and x - pts[columns[-1][-1]]["bytes_per_token_head"] < 1.0:
            columns[-1].append(i)
        else:
            columns.append([i])
    for ax, key, _ in panels:
        y = ys[key]
        for col in columns:
            floor = float("inf")
            for i in sorted(col, key=lambda i: -y[i]):
                x = pts[i]["bytes_per_token_head"]
                ypix = ax.transData.transform((x, y[i]))[1] * 72 / fig.dpi   # points
                want = min(ypix + 3, floor - 7)
                floor = want
                ax.annotate(pts[i]["name"], (x, y[i]), fontsize=6, xytext=(4, want - ypix),
                            textcoords="offset points")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return list(seen)


def goal_verdicts(rows, needle: dict | None = None) -> list[tuple[str, ...]]:
    """The rows of :func:`goal_lines`' table as ``(budget, shipped row, goal, measured,
    met?)`` string tuples (the stdout summary lists the goals not met)."""
    out = []
    for line in goal_lines(rows, needle)[3:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5:
            out.append(tuple(cells))
    return out


def print_summary(res, console=None) -> None:
    """Final summary table on stdout (rich)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: do not squeeze the table to 80 columns
            console = Console(width=160)
    rows = _rows(res)
    if rows:
        t = Table(title=f"tkv-calibrate: {res.model_name} "
                        f"({res.evaluation.windows}×{res.evaluation.window} test tokens)")
        for col in ("format", "B/tok/head", "cap×", "PPL", "ΔPPL", "KL", "top-1", "dec KL",
                    "dec top-1"):
            t.add_column(col, justify="left" if col == "format" else "right")
        for r in rows:
            t.add_row(r["name"], f"{r['bytes_per_token_head']:.1f}",
                      f"{r['capacity_vs_bf16']:.2f}", f"{r['ppl']:.3f}",
                      f"{r['delta_ppl_pct']:+.2f}%", _fmt_kl(r["kl"]), f"{100 * r['top1']:.1f}%",
                      _fmt_kl(r["decode_kl"]), _fmt_pct(r["decode_top1"]).replace(" %", "%"))
        console.print(t)
    for d in res.decisions:
        console.print(f"budget {d.budget:g}: shipped {d.chosen.source} "
                      f"(mix held-out KL {_fmt_kl(d.mix_measured_kl)} vs best uniform "
                      f"K{d.uniform[0]}V{d.uniform[1]} {_fmt_kl(d.uniform_measured_kl)})")
    if rows:
        verdicts = goal_verdicts(rows, getattr(res, "needle", None))
        missed = [v for v in verdicts if not v[-1].startswith("yes")]
        line = (f"goals (issue reference, report.md): {len(verdicts) - len(missed)} of "
                f"{len(verdicts)} met" + ("; not met: " if missed else "")
                + "; ".join(f"{b} {goal}: {got} " + (met[3:] if met.startswith("no (")
                                                      else f"({met})")
                            for b, _, goal, got, met in missed))
        console.print(line, soft_wrap=True)   # one line, however long, for logs and greps
    out = res.bundle_path.parent
    console.print(f"bundle: {res.bundle_path}   report: {out / 'report.md'}, "
                  f"{out / 'report.png'}   metrics: {out / 'metrics.json'}")
    console.print("timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res.timings.items()))
