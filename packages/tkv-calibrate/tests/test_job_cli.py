import json

import pytest

from tkv.calibrate.cli import main
from tkv.calibrate.errors import ModelNotFoundError, TextTooShortError, UnsupportedModelError
from tkv.calibrate.model import attention_geometry, default_model_path, load_model
from tkv.calibrate.needle import NeedleConfig, build_prompt, run_needle
from tkv.calibrate.pipeline import JobConfig, run_job
from tkv.codec import CalibrationBundle


@pytest.fixture(scope="module")
def job(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("job")
    cfg = JobConfig(out=str(out), budgets=(3.0, 4.0), calib_window=64, collect_windows=3,
                    sensitivity_windows=1, verify_windows=1, eval_window=64, eval_windows=2,
                    peers=True, show_progress=False)
    return run_job(cfg, loaded=tiny), out


def test_job_writes_valid_bundle_and_report(job, tiny):
    res, out = job
    b = CalibrationBundle.load(out / "tkv_bundle.json")
    assert b.budgets() == ["3.0", "4.0"]
    g = tiny.geometry
    b.check_geometry(g.num_layers, g.num_kv_heads, g.head_dim)
    for d in res.decisions:
        alloc = b.allocation(d.budget)
        # Never ship a mix that measured worse than the best uniform that fits the budget.
        if alloc.source == "smartmix":
            assert d.mix_measured_kl < d.uniform_measured_kl
        else:
            assert len(set(zip(alloc.k_bits, alloc.v_bits, strict=False))) == 1
    assert "evaluation" in b.metrics and b.metrics["evaluation"]["rows"]
    assert b.provenance["corpus"] == "valid.txt" and len(b.provenance["corpus_sha256"]) == 64
    # key centering is on by default; the bundle carries μ for every layer where it won
    assert b.provenance["key_centering"] == "per-head"
    # and so are sink offsets: every layer's codec codes against μ or the sink offset
    assert b.provenance["sink_offset"] is True
    assert all(layer.k_sink_offset is not None for layer in b.layers)
    for layer, sc in zip(b.layers, res.calibration.scales, strict=True):
        assert (layer.k_channel_offset is None) == (sc.k_offset is None)
    md = (out / "report.md").read_text()
    assert "SmartMix decisions" in md and "vLLM turboquant_4bit_nc" in md and "KIVI" in md
    # the timings name the machine they were taken on, not a fixed "2-core" claim
    import os
    assert f"wall clock; {os.cpu_count()} logical CPUs" in md
    assert (out / "report.png").stat().st_size > 10_000
    m = json.loads((out / "metrics.json").read_text())
    assert m["evaluation"]["baseline_ppl"] > 1
    # the stdout summary: the table, how many of the goals were met (a tiny random
    # model misses the quality ones), and where all four outputs are
    from rich.console import Console

    from tkv.calibrate.report import print_summary

    con = Console(record=True, width=200)
    print_summary(res, console=con)
    text = con.export_text()
    assert "goals (issue reference, report.md):" in text and "not met:" in text
    for f in ("tkv_bundle.json", "report.md", "report.png", "metrics.json"):
        assert f in text


def test_mix_widths_restrict_the_bundle_and_fail_early(tiny, tmp_path):
    """``mix_widths`` (``--mix-widths``): every row of the bundle uses only those widths and the
    provenance records them; a budget they cannot meet fails before any collection."""
    from tkv.codec.errors import TkvBitsError

    cfg = JobConfig(out=str(tmp_path), budgets=(3.0,), calib_window=64, collect_windows=2,
                    sensitivity_windows=1, verify_windows=1, eval_window=64, eval_windows=1,
                    decode=False, mix_widths=(4, 2), show_progress=False)
    run_job(cfg, loaded=tiny)
    b = CalibrationBundle.load(tmp_path / "tkv_bundle.json")
    alloc = b.allocation(3.0)
    assert set(alloc.k_bits) | set(alloc.v_bits) <= {2, 4}
    assert b.provenance["mix_widths"] == [2, 4]
    bad = JobConfig(out=str(tmp_path / "x"), budgets=(3.0,), mix_widths=(4, 8),
                    show_progress=False)
    with pytest.raises(TkvBitsError, match=r"TKV_BITS=3 cannot be met.*\[4, 8\]"):
        run_job(bad, loaded=tiny)
    assert not (tmp_path / "x").exists()


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model path not found" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["--budgets", "9.5"])
    assert e.value.code == 2
    assert "outside [2.0, 8.0]" in capsys.readouterr().err
    for bad, msg in (("2", "outside [0, 1)"), ("-0.1", "outside [0, 1)"), ("lots", "a fraction")):
        with pytest.raises(SystemExit) as e:
            main(["run", "--codebook-min-gain", bad])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    for bad, msg in (("2,9", "in 2..8"), ("4,x", "in 2..8"), ("1", "in 2..8"), (",", "at least")):
        with pytest.raises(SystemExit) as e:
            main(["run", "--mix-widths", bad])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    (tmp_path / "cfg").mkdir()
    assert main(["--model", str(tmp_path / "cfg")]) == 2
    assert "without config.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["run", "--eval-windows", "0"], "integer >= 1, got 0"),
    (["run", "--eval-window", "1"], "integer >= 2, got 1"),
    (["run", "--calib-window", "x"], "integer >= 2, got 'x'"),
    (["run", "--threads", "0"], "integer >= 1"),
    (["evaluate", "--eval-windows", "-3"], "integer >= 1, got -3"),
    (["needle", "--needles", "5"], "invalid choice: 5"),
    (["needle", "--max-new-tokens", "16"], "integer >= 24, got 16"),
    (["needle", "--lengths", "1024,4k"], "integer >= 64, got '4k'"),
    (["needle", "--lengths", ","], "at least one length"),
    (["needle", "--depths", "0.5,1.5"], "outside [0, 1]"),
    (["needle", "--depths", "mid"], "depth must be a number in [0, 1]"),
    (["run", "--budgets", ","], "at least one budget"),
    (["evaluate", "--budgets", " , "], "at least one budget"),
    (["needle", "--budgets", ","], "at least one budget"),
])
def test_cli_bad_counts_and_needle_grid_are_usage_errors(capsys, argv, msg):
    """Counts, window sizes and the needle grid are checked by argparse: one usage line, exit
    status 2, before torch or a model is loaded — never a ValueError traceback from deep in
    the job."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_cli_out_naming_a_file_and_non_utf8_text_are_one_line_errors(capsys, tmp_path):
    """`--out` naming an existing file is refused before the model loads (it used to end in a
    FileExistsError traceback after it); a calibration text that is not UTF-8 is a named
    TextEncodingError, one line, exit 2."""
    from tkv.calibrate.data import read_text
    from tkv.calibrate.errors import TextEncodingError

    f = tmp_path / "taken"
    f.write_text("x")
    (tmp_path / "model").mkdir()   # exists (no config.json): the --out check comes first
    assert main(["--model", str(tmp_path / "model"), "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert "is an existing file" in err and "Traceback" not in err
    b = tmp_path / "latin1.txt"
    b.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(TextEncodingError, match="not UTF-8"):
        read_text(b)


def test_job_config_validate_names_every_bad_setting(tmp_path):
    """JobConfig.validate applies the CLI's rules for callers that build the config: an empty
    budget list (it used to ship a K4V4 row nobody asked for), counts, center_keys, the
    codebook gain, threads, the seed, --out — each a named error before any model loads."""
    from tkv.calibrate.errors import JobConfigError
    from tkv.calibrate.pipeline import JobConfig
    from tkv.codec import TkvBitsError

    with pytest.raises(TkvBitsError, match="at least one budget"):
        JobConfig(budgets=()).validate()
    (tmp_path / "file").write_text("x")
    for kw, msg in ((dict(calib_window=1), "calib_window"), (dict(eval_windows=0), "eval_windows"),
                    (dict(collect_windows=2.5), "collect_windows"),
                    (dict(center_keys="weird"), "center_keys"),
                    (dict(codebook_min_gain=1.5), "codebook_min_gain"),
                    (dict(codebook_min_gain=-1), "codebook_min_gain"),
                    (dict(threads=0), "threads"), (dict(seed=1.5), "seed"),
                    (dict(seed=-1), "seed"), (dict(probe_bits=8), "probe_bits"),
                    (dict(out=str(tmp_path / "file")), "existing file")):
        with pytest.raises(JobConfigError, match=msg):
            JobConfig(**{"out": str(tmp_path / "o"), **kw}).validate()
    JobConfig(out=str(tmp_path / "o"), center_keys=False, threads=2, seed=2 ** 64 - 1).validate()


def test_cli_needle_choices_match_the_shipped_needles():
    from tkv.calibrate.cli import _parser
    from tkv.calibrate.needle import NEEDLES

    sub = next(a for a in _parser()._actions if a.dest == "cmd").choices["needle"]
    needles = next(a for a in sub._actions if a.dest == "needles")
    assert list(needles.choices) == list(range(1, len(NEEDLES) + 1))


def test_unsupported_and_missing_models(tmp_path):
    from transformers import LlamaConfig, T5Config

    with pytest.raises(UnsupportedModelError):
        attention_geometry(T5Config())
    cfg = LlamaConfig(num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError):
        attention_geometry(cfg)
    f = tmp_path / "model.bin"
    f.write_bytes(b"0")
    with pytest.raises(ModelNotFoundError):
        load_model(f)
    assert default_model_path().name.endswith(".gguf")


def test_text_too_short(tiny, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words\n")
    cfg = JobConfig(out=str(tmp_path), calib_text=str(short), show_progress=False)
    with pytest.raises(TextTooShortError):
        run_job(cfg, loaded=tiny)


def test_needle_prompt_and_run(tiny):
    hay = "Alpha beta gamma. " * 400
    ids = build_prompt(tiny.tokenizer, hay, 300, 0.5, "The code is 1234.", "What is the code?")
    text = tiny.tokenizer.decode(ids[0].tolist())
    assert "The code is 1234." in text and abs(ids.shape[1] - 300) <= 2
    with pytest.raises(TextTooShortError):
        build_prompt(tiny.tokenizer, "tiny", 300, 0.5, "x", "y")
    cfg = NeedleConfig(lengths=(320,), depths=(0.5,), num_needles=1, max_new_tokens=24)
    res = run_needle(tiny, None, cfg, show_progress=False)
    assert set(res["summary"]) == {"uncompressed", "TKV@4", "TKV@3"}
    cell = res["cells"][0]
    # A random tiny model cannot answer; the harness must still decode every arm.
    assert all(isinstance(cell[a]["answer"], str) for a in res["summary"])
    with pytest.raises(ValueError):
        NeedleConfig(max_new_tokens=8).validate()


def test_evaluate_existing_bundle(job, tiny, tmp_path):
    from tkv.calibrate.pipeline import evaluate_bundle

    _res, out = job
    r = evaluate_bundle(str(out / "tkv_bundle.json"), str(tmp_path), eval_windows=1,
                        eval_window=64, peers=False, decode=False, show_progress=False,
                        loaded=tiny)
    names = [x["name"] for x in r["rows"]]
    assert any(n.startswith("TKV@3") for n in names) and any(n.startswith("TKV@4") for n in names)
    assert (tmp_path / "evaluation.md").is_file() and (tmp_path / "evaluation.png").is_file()


def test_center_keys_flag():
    """--center-keys per-head (default) | shared | off; --no-center-keys means off."""
    from tkv.calibrate.cli import _parser

    assert _parser().parse_args(["run"]).center_keys == "per-head"
    assert _parser().parse_args(["run", "--center-keys", "shared"]).center_keys == "shared"
    assert _parser().parse_args(["run", "--no-center-keys"]).center_keys == "off"
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--center-keys", "per-layer"])


def test_sink_offset_flag():
    """Sink offsets are on by default; --no-sink-offset turns them off."""
    from tkv.calibrate.cli import _parser

    assert _parser().parse_args(["run"]).sink_offset is True
    assert _parser().parse_args(["run", "--no-sink-offset"]).sink_offset is False
    assert JobConfig().sink_offset is True


def test_sink_offset_job_calibrates_and_evaluates_sink_offsets(tiny, tmp_path):
    """Sink offsets (the default): every layer of the bundle carries per-head K and V sink offsets (the mean
    position-0 key / value of one-token forwards), the codecs built from it use them, and the
    whole job (sensitivity, SmartMix, evaluation) runs through them with finite metrics."""
    import torch

    from tkv.calibrate.collect import sink_offsets

    cfg = JobConfig(out=str(tmp_path), budgets=(4.0,), calib_window=64, collect_windows=2,
                    sensitivity_windows=1, verify_windows=1, eval_window=64, eval_windows=1,
                    decode=False, show_progress=False)
    run_job(cfg, loaded=tiny)
    b = CalibrationBundle.load(tmp_path / "tkv_bundle.json")
    g = tiny.geometry
    assert b.provenance["sink_offset"] is True
    for i, layer in enumerate(b.layers):
        assert len(layer.k_sink_offset) == len(layer.v_sink_offset) == g.num_kv_heads * g.head_dim
        assert b.codec(i, 4, 4).has_sink_offset
    # the offsets are the position-0 means over the calibration windows' every 64th token
    from tkv.calibrate.data import default_calib_text, tokenize_windows

    w = tokenize_windows(tiny.tokenizer, default_calib_text(), 64, 4).subset(0, 2)
    sinks = sink_offsets(tiny.model, w[:, ::64].reshape(-1))
    for layer, (k, v) in zip(b.layers, sinks, strict=True):
        assert torch.allclose(torch.tensor(layer.k_sink_offset), k.flatten(), atol=1e-6)
        assert torch.allclose(torch.tensor(layer.v_sink_offset), v.flatten(), atol=1e-6)
    one = sink_offsets(tiny.model, w[:1, 0])[0][0]
    assert not torch.allclose(one, sinks[0][0])     # a mean over tokens, not the first one
    rows = b.metrics["evaluation"]["rows"]
    assert rows and all(r["kl"] >= 0 and r["kl"] == r["kl"] for r in rows)


def test_sink_offset_helpers_name_bad_input(tiny):
    """No tokens for sink_offsets, or vectors without a head axis for compress_bhtd with
    per-head offsets: named errors, not a failure deep inside the model or an IndexError."""
    import torch

    from tkv.calibrate.collect import sink_offsets
    from tkv.calibrate.quantizers import compress_bhtd
    from tkv.codec import TurboKVCodec
    from tkv.codec.errors import ShapeError

    with pytest.raises(ValueError, match="at least one token"):
        sink_offsets(tiny.model, torch.zeros(0, dtype=torch.long))
    c = TurboKVCodec(32, 4, v_sink_offset=torch.zeros(2, 32))
    with pytest.raises(ShapeError, match="num_kv_heads, T, head_dim"):
        compress_bhtd(c.v, torch.randn(5, 32))


def test_report_plot_keys_every_group_and_staggers_labels(tmp_path):
    """report.png: the legend names every group present — the rejected SmartMix colour too
    (it was missing from the old title key) — and two arms at the same bytes (a rejected mix
    on its uniform row) get labels at different heights."""
    import matplotlib.axes
    from matplotlib.text import Annotation

    from tkv.calibrate import report

    def row(name, group, kl, ppl, b=84.0):
        return {"name": name, "group": group, "bytes_per_token_head": b, "kl": kl,
                "delta_ppl_pct": ppl}

    rows = [row("uncompressed", "baseline", 0.0, 0.0, 256.0),
            row("TKV@5 uniform K5V5", "tkv", 0.0042, 0.41),
            row("TKV@5 SmartMix (rejected)", "smartmix-rejected", 0.00425, 0.40),
            row("fp8", "peer", 0.07, 8.6, 128.0)]   # wide ranges: the TKV@5 points ~1 pt apart
    offsets = []
    real = matplotlib.axes.Axes.annotate

    def spy(self, text, xy, **kw):
        a = real(self, text, xy, **kw)
        assert isinstance(a, Annotation)
        at = self.transData.transform(xy)[1] * 72 / self.figure.dpi + kw["xytext"][1]
        offsets.append((self, text, at))   # the label's height on the page, points
        return a

    matplotlib.axes.Axes.annotate = spy
    try:
        keys = report.plot_rows(rows, "tiny", tmp_path / "r.png")
    finally:
        matplotlib.axes.Axes.annotate = real
    assert keys == ["uniform TKV", "SmartMix (measured worse, not shipped)", "peer formats"]
    assert (tmp_path / "r.png").stat().st_size > 10_000
    for ax in {o[0] for o in offsets}:
        same_bytes = [(t, at) for a, t, at in offsets if a is ax and t.startswith("TKV@5")]
        (_, hi), (_, lo) = same_bytes
        assert abs(hi - lo) >= 6.9, same_bytes
