"""Speed-quality plots of bench records (`diffar bench ... --plot`, `diffar bench plot`). Which records become
which points (`select`) is kept apart from drawing them (`draw`), so the choice is tested without pixels.

Speed is the x axis: tokens/s, or for a DD2 bench (whose claim is latency) the latency per batch. Quality is
the y axis: for continuation (records that carry the AR model's perplexity) the outside scorer's perplexity,
else the AR model's; otherwise BLEU-4, else chrF. Records without any (`bench ar`, the `--set` runs: lossless
or timing-only) are drawn as speed per method. One panel per task and batch size (and dtype, where the
records mix several); one marker per method, the same in every panel."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from diffar.errors import DiffarError

FIELDS = ("method", "task", "batch_size", "tokens_per_s", "latency_ms", "device", "extra")  # what a record needs
CONTINUATION = ("scorer_perplexity", "ar_perplexity")  # quality figures in order of preference
SEQ2SEQ = ("bleu4", "chrf")
LABELS = {
    "tokens_per_s": "tokens/s (higher is better)", "latency_ms": "latency per batch, ms (lower is better)",
    "bleu4": "BLEU-4", "chrf": "chrF", "scorer_perplexity": "scorer perplexity (lower is better)",
    "ar_perplexity": "AR perplexity (lower is better)",
}
FORMATS = ("png", "svg", "pdf")
MARKERS = ("s", "^", "D", "v", "P", "X", "*", "<", ">", "p", "h")  # "ar" is the black circle
COLOURS = tuple(f"C{i}" for i in range(10))  # matplotlib's default cycle


@dataclass(frozen=True)
class Point:
    method: str
    speed: float
    quality: float | None  # None: the records carry no quality figure


@dataclass(frozen=True)
class Panel:
    title: str
    points: list[Point]


@dataclass(frozen=True)
class Selection:
    speed: str  # the records' field on the x axis
    quality: str | None  # the `extra` key on the y axis; None: speed per method
    methods: list[str]  # in order of first appearance: each its marker, alike in every panel
    panels: list[Panel]
    title: str  # hardware, dtype and the dates measured (records older than the field carry none)


def load_records(path: str | Path) -> list[dict]:
    """The records of a JSON file that `diffar bench` wrote."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError:  # not JSON, not text
        data = None
    if not isinstance(data, list) or not all(
            isinstance(r, dict) and all(f in r for f in FIELDS) and isinstance(r["extra"], dict)
            and all(isinstance(r[f], (int, float)) for f in ("batch_size", "tokens_per_s", "latency_ms"))
            for r in data):
        raise DiffarError(f"{path} is not a `diffar bench` JSON file (a list of records with {', '.join(FIELDS)})")
    return data


def _quality(records: list[dict]) -> str | None:
    """The first quality figure every record carries (CONTINUATION for continuation records, SEQ2SEQ else)."""
    extras = [r["extra"] for r in records]
    keys = CONTINUATION if all("ar_perplexity" in e for e in extras) else SEQ2SEQ
    return next((k for k in keys if all(isinstance(e.get(k), (int, float)) for e in extras)), None)


def _unique(values) -> list:
    return list(dict.fromkeys(values))


def _dtype(record: dict) -> str:
    return record.get("dtype", "fp32")  # records older than the field were all fp32


def select(records: list[dict]) -> Selection:
    """The points of `records` (dicts as `diffar bench` writes them), grouped into panels."""
    if not records:
        raise DiffarError("no bench records to plot")
    speed = "latency_ms" if any(r["method"].startswith("dd2") for r in records) else "tokens_per_s"
    quality = _quality(records)
    dtypes = _unique(map(_dtype, records))
    panels: dict[tuple, list[Point]] = {}
    for r in records:
        point = Point(r["method"], r[speed], r["extra"][quality] if quality else None)
        panels.setdefault((r["task"], r["batch_size"], _dtype(r)), []).append(point)
    hardware = _unique(r["device"] if r["extra"].get("device_kind", "cpu") == "cpu"
                       else f"{r['device']}, {r['extra']['device_kind']}" for r in records)
    return Selection(
        speed=speed, quality=quality, methods=_unique(r["method"] for r in records),
        panels=[Panel(f"{task}, batch {bs}" + (f", {dt}" if len(dtypes) > 1 else ""), points)
                for (task, bs, dt), points in panels.items()],
        title=" · ".join([" / ".join(hardware), " / ".join(dtypes),
                          *filter(None, [" / ".join(sorted({r["date"] for r in records if r.get("date")}))])]))


def draw(selection: Selection):
    """A matplotlib Figure (Agg canvas: no display needed) of `selection`, one scatter call per point."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(selection.panels)
    cols = 1 if n == 1 else 3 if n % 3 == 0 else 2
    rows = math.ceil(n / cols)
    height = 2.5 if selection.quality else 0.7 + 0.3 * len(selection.methods)
    figure = Figure(figsize=(2.6 * cols + 1.7, height * rows + 0.5), layout="constrained")
    FigureCanvasAgg(figure)
    # speed per method: one row per method, shared by every panel (the left column names them)
    axes = list(figure.subplots(rows, cols, squeeze=False, sharey=selection.quality is None).flat)
    style = {m: dict(color="black", marker="o") if m == "ar" else
             dict(color=COLOURS[i % len(COLOURS)], marker=MARKERS[i % len(MARKERS)])
             for i, m in enumerate(selection.methods)}
    speeds = [p.speed for panel in selection.panels for p in panel.points]
    # a wide range of speeds (DD2's 1 to 100 steps) on a log axis
    log = selection.quality is not None and min(speeds) > 0 and max(speeds) / min(speeds) > 10
    legend = {}  # method -> one of its points
    for ax, panel in zip(axes, selection.panels):
        for p in panel.points:
            y = p.quality if selection.quality else selection.methods.index(p.method)
            legend[p.method] = ax.scatter([p.speed], [y], s=36, **style[p.method])
        if selection.quality is None:
            ax.set_yticks(range(len(selection.methods)), selection.methods, fontsize="small")
            ax.set_ylim(len(selection.methods) - 0.5, -0.5)
            ax.set_xlim(0, 1.08 * max(p.speed for p in panel.points))  # speed from 0, the fastest clear of the edge
        else:  # at least one point of quality high: lossless methods' ties and rounding are not drawn as gulfs
            low, high = ax.get_ylim()
            ax.set_ylim(min(low, (low + high - 1) / 2), max(high, (low + high + 1) / 2))
        if log:
            ax.set_xscale("log")
        ax.set_title(panel.title, fontsize="medium")
        ax.grid(alpha=0.3)
    for ax in axes[len(selection.panels):]:  # the grid's unused cells
        ax.set_visible(False)
    figure.supxlabel(LABELS[selection.speed], fontsize="medium")
    if selection.quality:
        figure.supylabel(LABELS[selection.quality], fontsize="medium")
        figure.legend([legend[m] for m in selection.methods], selection.methods, loc="outside right center",
                      fontsize="small", frameon=False)
    figure.suptitle(selection.title, fontsize="medium")
    return figure


def save(figure, out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    print(f"wrote the plot to {out}")
