"""Speed-quality plots (diffar/evaluation/plot.py): which records become which points, the figure drawn from
them, and the CLI around it (`bench plot`, `bench ... --plot`)."""

from __future__ import annotations

import json

import pytest

from diffar.errors import DiffarError
from diffar.evaluation.plot import draw, load_records, select
from conftest import assert_clean_error, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


def record(method: str, batch_size: int = 1, task: str = "kjv2web", **extra) -> dict:
    """A bench record as `diffar bench` writes it, with made-up speeds."""
    return dict(method=method, task=task, batch_size=batch_size, prompt_tokens=20, new_tokens=30,
                latency_ms=10.0 * (len(method) + batch_size), tokens_per_s=100.0 * batch_size + len(method),
                forward_passes=30, device="Test CPU (2 cores)", torch_threads=2, dtype="fp32", extra=extra)


def points_drawn(figure) -> int:
    return sum(len(c.get_offsets()) for ax in figure.axes for c in ax.collections)


def test_seq2seq_dd2_records_are_latency_against_bleu_a_panel_per_batch_size():
    records = [record(m, bs, bleu4=b, chrf=70.0) for bs in (1, 16) for m, b in (("ar", 65.2), ("dd2-1", 67.6))]
    for r in records:
        r["date"] = "2026-12-06"  # the day each was measured (records before the field have none)
    selection = select(records)
    assert (selection.speed, selection.quality, selection.methods) == ("latency_ms", "bleu4", ["ar", "dd2-1"])
    assert [p.title for p in selection.panels] == ["kjv2web, batch 1", "kjv2web, batch 16"]
    assert [(p.method, p.speed, p.quality) for p in selection.panels[1].points] == [
        ("ar", 180.0, 65.2), ("dd2-1", 210.0, 67.6)]
    assert selection.title == "Test CPU (2 cores) · fp32 · 2026-12-06"
    assert points_drawn(draw(selection)) == 4


def test_quality_figure_preference():
    continuation = [record("ar", task="shakespeare", ar_perplexity=3.8, scorer_perplexity=5.6, bleu4=1.5),
                    record("dd2-1", task="shakespeare", ar_perplexity=20.7, scorer_perplexity=9.0, bleu4=0.0)]
    assert select(continuation).quality == "scorer_perplexity"  # the outside judge first
    for r in continuation:
        del r["extra"]["scorer_perplexity"]
    assert select(continuation).quality == "ar_perplexity"  # not BLEU against the real continuation
    mixed = [record("ar", bleu4=64.9, chrf=79.0), record("refusion", chrf=79.0)]
    assert select(mixed).quality == "chrf"  # the first figure every record has
    lossless = select([record("ar", tokens_per_ar_pass=1.0), record("ar+prompt-lookup", tokens_per_ar_pass=2.3)])
    assert (lossless.speed, lossless.quality) == ("tokens_per_s", None)
    assert [(p.method, p.quality) for p in lossless.panels[0].points] == [("ar", None), ("ar+prompt-lookup", None)]
    with pytest.raises(DiffarError, match="no bench records to plot"):
        select([])


def test_speed_only_rows_are_the_methods_and_dtypes_split_panels():
    records = [record(m, bs) | {"dtype": dt} for dt in ("fp32", "bf16") for bs in (1, 8) for m in ("ar", "ar-nocache")]
    selection = select(records)
    assert [p.title for p in selection.panels] == ["kjv2web, batch 1, fp32", "kjv2web, batch 8, fp32",
                                                   "kjv2web, batch 1, bf16", "kjv2web, batch 8, bf16"]
    assert selection.title == "Test CPU (2 cores) · fp32 / bf16"
    figure = draw(selection)
    assert points_drawn(figure) == 8
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["ar", "ar-nocache"]


@pytest.mark.parametrize("content", ['{"examples": 8}', '[{"method": "ar"}]', "not json", '[{"method": "ar", '
                                     '"task": "t", "batch_size": 1, "tokens_per_s": "fast", "latency_ms": 1, '
                                     '"device": "d", "extra": {}}]'])
def test_files_that_are_not_bench_json(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(DiffarError, match="is not a `diffar bench` JSON file"):
        load_records(path)


def test_cli_bench_plot_draws_saved_records(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([record("ar", bleu4=65.0), record("refusion", bleu4=65.0)]))
    b.write_text(json.dumps([record("ar", 8, bleu4=64.0), record("refusion", 8, bleu4=64.0)]))
    out = tmp_path / "plots" / "speed.png"
    proc = run_cli("bench", "plot", "--results", a, b, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG) and f"wrote the plot to {out}" in proc.stdout
    assert [len(p.points) for p in select(load_records(a) + load_records(b)).panels] == [2, 2]


@pytest.mark.parametrize("case, message", [
    ("missing", "No such file"), ("dict", "is not a `diffar bench` JSON file"), ("empty", "no bench records"),
    ("unwritable", "r.json: File exists"), ("suffix", "--out: must end in .png, .svg, .pdf"),
])
def test_cli_bench_plot_bad_input(tmp_path, case, message):
    results, out = tmp_path / "r.json", tmp_path / "p.png"
    results.write_text({"dict": '{"examples": 8}', "empty": "[]"}.get(case, json.dumps([record("ar")])))
    if case == "missing":
        results.unlink()
    if case == "unwritable":
        out = results / "p.png"  # under a file
    if case == "suffix":
        out = tmp_path / "p.txt"
    assert_clean_error(run_cli("bench", "plot", "--results", results, "--out", out), message)


def test_bench_with_plot(tiny_run, tmp_path):
    """`--plot` on a real (tiny) bench: the JSON and a PNG of its records, AR and the peer at each batch size."""
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    proc = run_cli("bench", "speculative", "--checkpoint", tiny_run, "--methods", "ar", "ar+prompt-lookup",
                   "--prompts", "2", "--new-tokens", "8", "--batch-sizes", "1", "2", "--out", out, "--plot", png)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes().startswith(PNG)
    selection = select(load_records(out))
    assert selection.quality == "bleu4"
    assert [(p.title, [q.method for q in p.points]) for p in selection.panels] == [
        ("kjv2web, batch 1", ["ar", "ar+prompt-lookup"]), ("kjv2web, batch 2", ["ar", "ar+prompt-lookup"])]
