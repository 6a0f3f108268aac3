"""The README's figures, drawn from committed results as plain SVG (no plotting library needed).

    python -m eval figures            # rewrites docs/figures/*.svg

- ``fsd_tradeoff.svg``: arithmetic accuracy against tokens/s across FSD thresholds, one line per divergence,
  from the reproduction's greedy sweeps (``eval/results/reproduction/sweep-{head,draft}-t0/results.json``):
  the fine-tuned target with its EAGLE head and with a small draft model.
- ``batch_speedup.svg``: speedup over our batched autoregressive decoding against the batch size, EAGLE-2
  and FSD, from the batched benchmark (``eval/results/gpu_batch.json``).

Each figure names its source file, device, date and commit in its caption.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from fsd_eagle.jsonl import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "eval" / "results"
OUT = ROOT / "docs" / "figures"
COLORS = {"kl": "#1f77b4", "reverse_kl": "#d62728", "js": "#2ca02c", "eagle2": "#1f77b4",
          "fsd": "#d62728", "ar": "#888888"}
SWEEPS = {"EAGLE head": "reproduction/sweep-head-t0/results.json",
          "draft model": "reproduction/sweep-draft-t0/results.json"}
BATCH = "gpu_batch.json"
MARK = "<!-- drawn by python -m eval figures -->"  # a file without it is not ours to replace


def replaceable(path: Path) -> bool:
    """Whether a figure may be written at ``path``: nothing is there, or a figure these scripts drew."""
    return not path.exists() or MARK in path.read_text(errors="replace")


@dataclass
class Series:
    name: str
    color: str
    points: list[tuple[float, float]]
    labels: list[str] = field(default_factory=list)  # one per point, or none
    dashed: bool = False


@dataclass
class Panel:
    """One plot: its series, axis titles and ranges; ``log_x``: a base-2 x axis (batch sizes)."""

    title: str
    x_title: str
    y_title: str
    series: list[Series]
    log_x: bool = False
    legend: str = "lower left"  # or "upper right", "upper left": where no points are
    y_range: tuple[float, float] | None = None  # the y values to span (panels that share a scale); None: the data's


def svg(panels: list[Panel], caption: list[str], width: int = 440, height: int = 300) -> str:
    """Panels side by side, each ``width`` x ``height`` pixels, and the caption's lines under them."""
    total_w, total_h = width * len(panels), height + 14 + 14 * len(caption)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
             f'viewBox="0 0 {total_w} {total_h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{total_w}" height="{total_h}" fill="white"/>']
    for i, panel in enumerate(panels):
        parts.append(draw_panel(panel, i * width, width, height))
    for i, line in enumerate(caption):
        parts.append(f'<text x="8" y="{height + 18 + 14 * i}" font-size="10" fill="#444">{escape(line)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n" + MARK + "\n"


def draw_panel(panel: Panel, left: int, width: int, height: int) -> str:
    m_left, m_right, m_top, m_bottom = 52, 12, 28, 42
    xs = [x for s in panel.series for x, _ in s.points]
    ys = [y for s in panel.series for _, y in s.points]
    fx = (lambda v: math.log2(v)) if panel.log_x else (lambda v: v)
    x_lo, x_hi = fx(min(xs)), fx(max(xs))
    y_lo, y_hi = min(ys), max(ys)
    if panel.y_range is not None:
        y_lo, y_hi = min(y_lo, panel.y_range[0]), max(y_hi, panel.y_range[1])
    y_ticks = ticks(y_lo, y_hi)
    pad_x, pad_y = (x_hi - x_lo) * 0.05 or 1, (y_hi - y_lo) * 0.08 or 1
    x_lo, x_hi, y_lo, y_hi = x_lo - pad_x, x_hi + pad_x, y_lo - pad_y, y_hi + pad_y
    plot_w, plot_h = width - m_left - m_right, height - m_top - m_bottom

    def px(v: float) -> float:
        return left + m_left + (fx(v) - x_lo) / (x_hi - x_lo) * plot_w

    def py(v: float) -> float:
        return m_top + (1 - (v - y_lo) / (y_hi - y_lo)) * plot_h

    out = [f'<text x="{left + width / 2}" y="16" text-anchor="middle" font-size="12" font-weight="bold">'
           f'{escape(panel.title)}</text>',
           f'<rect x="{left + m_left}" y="{m_top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    x_ticks = sorted(set(xs)) if panel.log_x else ticks(min(xs), max(xs))
    for t in x_ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{m_top + plot_h}" x2="{px(t):.1f}" y2="{m_top + plot_h + 4}" stroke="#999"/>'
                   f'<text x="{px(t):.1f}" y="{m_top + plot_h + 15}" text-anchor="middle">{fmt(t)}</text>')
    for t, label in zip(y_ticks, tick_labels(y_ticks)):
        out.append(f'<line x1="{left + m_left - 4}" y1="{py(t):.1f}" x2="{left + m_left + plot_w}" y2="{py(t):.1f}" '
                   f'stroke="#eee"/><text x="{left + m_left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{label}</text>')
    out.append(f'<text x="{left + m_left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{escape(panel.x_title)}</text>')
    out.append(f'<text transform="translate({left + 12},{m_top + plot_h / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(panel.y_title)}</text>')
    for k, s in enumerate(panel.series):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="4 3"' if s.dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.6"{dash}/>')
        for (x, y), label in zip(s.points, s.labels or [""] * len(s.points)):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.6" fill="{s.color}"/>')
            if label:  # beside the point, on its left where the plot's right edge would cut it (9-pixel text)
                right = px(x) + 4 + 5.5 * len(label) > left + m_left + plot_w
                anchor = ' text-anchor="end"' if right else ""
                out.append(f'<text x="{px(x) + (-4 if right else 4):.1f}" y="{py(y) - 4:.1f}" font-size="9" '
                           f'fill="{s.color}"{anchor}>{escape(label)}</text>')
        if panel.legend == "lower left":
            lx, ly = left + m_left + 8, m_top + plot_h - 8 - 13 * (len(panel.series) - 1 - k)
        elif panel.legend == "upper left":
            lx, ly = left + m_left + 8, m_top + 14 + 13 * k
        else:
            lx, ly = left + m_left + plot_w - 150, m_top + 14 + 13 * k
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 16}" y2="{ly - 4}" stroke="{s.color}" stroke-width="2"{dash}/>'
                   f'<text x="{lx + 20}" y="{ly}">{escape(s.name)}</text>')
    return "\n".join(out)


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: the largest step of 1, 2 or 5 times a power of ten that gives at most
    ``count`` spans, or the next smaller one where that leaves fewer than three ticks."""
    span = hi - lo or abs(hi) or 1.0
    base = 10 ** math.floor(math.log10(span / count))
    steps = [base * factor for factor in (1, 2, 5, 10)]
    chosen = next(i for i, step in enumerate(steps) if span / step <= count)

    def values(step: float) -> list[float]:
        first = math.ceil(lo / step) * step
        return [first + i * step for i in range(int((hi - first) / step) + 1)]

    if chosen > 0 and len(values(steps[chosen])) < 3:
        chosen -= 1
    return values(steps[chosen])


def tick_labels(values: list[float]) -> list[str]:
    """Tick values as text with the fewest decimals that tell them apart (``fmt`` where that does)."""
    labels = [fmt(v) for v in values]
    decimals = 1
    while len(set(labels)) < len(labels) and decimals < 6:
        decimals += 1
        labels = [f"{v:.{decimals}f}" for v in values]
    return labels


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.2g}" if abs(v) < 1 else f"{v:.1f}"


def read(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def source(meta: dict, name: str) -> str:
    commit = meta.get("git_commit") or "?"
    return f"eval/results/{name} ({meta.get('device')}, {str(meta.get('date'))[:10]}, code {commit})"


def tradeoff() -> str:
    """Arithmetic accuracy (%) against tokens/s, per divergence, thresholds labelled; the exact rule as T = 0."""
    panels, sources = [], []
    for title, name in SWEEPS.items():
        data = read(name)
        rows = data["rows"]
        exact = next(r for r in rows if r["method"] in ("eagle2", "sd"))
        series = [Series("plain (AR)", COLORS["ar"], [(r["tokens_per_s"], 100 * r["arith_acc"])
                                                     for r in rows if r["method"] == "ar"])]
        for div in ("kl", "reverse_kl", "js"):
            fuzzy = sorted((r for r in rows if r["method"] == "fsd" and r["divergence"] == div),
                           key=lambda r: r["threshold"])
            if fuzzy:
                chain = [exact] + fuzzy
                series.append(Series(f"FSD {div}", COLORS[div], [(r["tokens_per_s"], 100 * r["arith_acc"]) for r in chain],
                                     ["T=0" if div == "kl" else ""] + [f"{r['threshold']:g}" for r in fuzzy]))
        panels.append(Panel(f"target + {title}", "tokens/s (greedy, one prompt at a time)",
                            "arithmetic accuracy (%)", series))
        sources.append(source(data["meta"], name))
    return svg(panels, ["FSD on a fine-tuned SmolLM2-135M, 400 arithmetic problems, greedy: accuracy against speed "
                        "across thresholds T (T = 0: exact speculative decoding)."] + sources)


def batch_speedup() -> str:
    data = read(BATCH)
    rows = data["rows"]
    ar = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    series = []
    for method, name in (("eagle2", "EAGLE-2 (exact)"), ("fsd", "FSD reverse_kl T = 1")):
        points = sorted((r["batch_size"], r["tokens_per_s"] / ar[r["batch_size"]]) for r in rows
                        if r["method"] == method and r["batch_size"] in ar)
        series.append(Series(name, COLORS[method], points, [f"{y:.2f}x" for _, y in points] if method == "eagle2" else []))
    series.append(Series("plain (AR) = 1", COLORS["ar"], [(min(ar), 1.0), (max(ar), 1.0)], dashed=True))
    panel = Panel("speedup over batched plain decoding", "prompts decoded together (batch size)",
                  "tokens/s over AR", series, log_x=True, legend="upper right")
    return svg([panel], ["generate(prompts, batch_size=B): 480 MT-bench and Spec-Bench prompts, 256 tokens each, "
                         "greedy, compiled rounds.", source(data["meta"], BATCH)], width=620)


FIGURES = {"fsd_tradeoff.svg": tradeoff, "batch_speedup.svg": batch_speedup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval figures", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help=f"folder of the SVG files (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    foreign = [args.out / n for n in FIGURES if not replaceable(args.out / n)]
    if foreign:
        print(f"error: {foreign[0]} exists and was not drawn by this command: not replaced (choose another --out)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES.items():
        write_text_atomic(args.out / name, draw())
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
