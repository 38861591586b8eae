"""Turns benchmark records (benchmarks/results/*.json) into a markdown table and a PNG chart.

    .venv/bin/python scripts/make_results_table.py [--results DIR] [--table PATH|-] [--chart PATH]
                                                   [--readme]

Each JSON file holds one record or a list of records with the keys
`bench, shape, backend, time_us, floor_us, baseline ({name, time_us} or null), date, commit,
device, command` (and optionally `note`, listed under the table). The table (default
benchmarks/results/README.md; `-` prints it) has one row per record; the chart (default
docs/results.png) draws, per case, our time beside the bandwidth floor and the baseline,
labelled with device and date. With no records, the table says
so and no chart is drawn (an old chart is left untouched). `--readme` also replaces the text
between `<!-- results:begin -->` and `<!-- results:end -->` in README.md with the table and chart.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"
REQUIRED = (
    "bench",
    "shape",
    "backend",
    "time_us",
    "floor_us",
    "baseline",
    "date",
    "commit",
    "device",
    "command",
)

__all__ = [
    "load_records",
    "markdown_table",
    "plot_records",
    "case_label",
    "shape_str",
    "update_readme",
    "main",
]


def load_records(results_dir: str | os.PathLike) -> list[dict]:
    """Every record of every *.json file in `results_dir`, sorted by bench, shape, backend.

    A file that is not JSON, or an entry that lacks a required key (e.g. a block-size sweep
    saved beside the results), is skipped with a warning on stderr naming the file and the
    missing keys. A record whose `time_us` is null (a failed case) is kept: the table shows it.
    """
    records = []
    for path in sorted(glob.glob(os.path.join(os.fspath(results_dir), "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"warning: skipping {path}: {e}", file=sys.stderr)
            continue
        for rec in data if isinstance(data, list) else [data]:
            missing = [k for k in REQUIRED if not isinstance(rec, dict) or k not in rec]
            if missing:
                name = rec.get("bench", "?") if isinstance(rec, dict) else type(rec).__name__
                print(
                    f"warning: skipping a record {name!r} of {path}: lacks keys {missing}",
                    file=sys.stderr,
                )
                continue
            records.append(dict(rec, _file=os.path.basename(path)))
    return sorted(records, key=lambda r: (r["bench"], shape_str(r["shape"]), r["backend"]))


def shape_str(shape) -> str:
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    if isinstance(shape, list | tuple):
        return "x".join(str(s) for s in shape)
    return str(shape)


def case_label(rec: dict) -> str:
    """`bench shape backend`, one line per case."""
    return f"{rec['bench']} [{shape_str(rec['shape'])}] {rec['backend']}"


def _us(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def markdown_table(records: list[dict]) -> str:
    """A markdown table of the records, with floor and baseline ratios; a note when empty."""
    if not records:
        return (
            "No benchmark results yet: run `benchmarks/bench_*.py --out benchmarks/results/"
            "<name>.json` on a GPU, then `scripts/make_results_table.py`.\n"
        )
    lines = [
        "| bench | shape | backend | time (µs) | floor (µs) | time / floor | baseline | "
        "baseline (µs) | speed-up vs baseline | device | date | commit |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---|---|---|",
    ]
    notes: list[str] = []  # a record's optional "note" (e.g. why a figure is unreliable)
    for r in records:
        t, floor, base = r["time_us"], r["floor_us"], r["baseline"]
        ratio = "-" if not (floor and t) else f"{t / floor:.2f}"
        b_name = base["name"] if base else "-"
        b_time = base.get("time_us") if base else None
        speedup = "-" if not (b_time and t) else f"{b_time / t:.2f}×"
        ours = _us(t) if t is not None else f"failed: {str(r.get('error', '?'))[:60]}"
        if r.get("note"):
            if r["note"] not in notes:
                notes.append(r["note"])
            ours += f" (note {notes.index(r['note']) + 1})"
        lines.append(
            f"| {r['bench']} | {shape_str(r['shape'])} | {r['backend']} | {ours} | "
            f"{_us(floor)} | {ratio} | {b_name} | {_us(b_time)} | {speedup} | {r['device']} | "
            f"{r['date']} | {str(r['commit'])[:10]} |"
        )
    if notes:
        lines += ["", "Notes:", *[f"{i + 1}. {n}" for i, n in enumerate(notes)]]
    commands = sorted({r["command"] for r in records})
    lines += ["", "Commands:", *[f"- `{c}`" for c in commands], ""]
    return "\n".join(lines)


def plot_records(records: list[dict], path: str | os.PathLike | None = None):
    """Horizontal bars per case: our time, the floor and the baseline (µs, log scale).

    Returns the matplotlib figure (None when there are no records); saves it when `path` is set.
    """
    records = [r for r in records if r["time_us"]]  # failed cases have no bar
    if not records:
        return None
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [case_label(r) for r in records]
    n = len(records)
    fig, ax = plt.subplots(figsize=(10, 1.2 * n + 2.0))
    y = range(n)
    h = 0.27
    ours = [r["time_us"] for r in records]
    floors = [r["floor_us"] or 0 for r in records]
    bases = [(r["baseline"] or {}).get("time_us") or 0 for r in records]
    ax.barh([i - h for i in y], ours, h, label="kda-jax", color="tab:blue")
    ax.barh(list(y), floors, h, label="bandwidth floor", color="tab:gray")
    ax.barh([i + h for i in y], bases, h, label="baseline", color="tab:orange")
    for i, r in enumerate(records):
        if r["baseline"]:
            ax.text(bases[i], i + h, f" {r['baseline']['name']}", va="center", fontsize=7)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time per call (µs, log scale)")
    devices = sorted({r["device"] for r in records})
    dates = sorted({str(r["date"]) for r in records})
    ax.set_title(
        f"{', '.join(devices)} | {dates[0]}" + (f" .. {dates[-1]}" if len(dates) > 1 else "")
    )
    top = max(ours + floors + bases)
    ax.set_xlim(right=top * 4)  # room for the baseline names
    for i, r in enumerate(records):
        if r["floor_us"]:
            ax.text(
                ours[i], i - h, f" {ours[i] / r['floor_us']:.2f}× floor", va="center", fontsize=7
            )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8)
    fig.tight_layout()
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def update_readme(readme: str | os.PathLike, table: str, chart: str | None) -> None:
    """Replaces the README's results section (between the markers) with `table` and the chart."""
    path = Path(readme)
    text = path.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{path} lacks the markers {README_BEGIN} ... {README_END}")
    body = table.strip() + "\n"
    if chart:
        body += f"\n![benchmark results]({chart})\n"
    text = text[: start + len(README_BEGIN)] + "\n" + body + text[end:]
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--results", default=ROOT / "benchmarks" / "results", type=Path)
    ap.add_argument(
        "--table", default=None, help="markdown output (default DIR/README.md; - prints)"
    )
    ap.add_argument("--chart", default=ROOT / "docs" / "results.png", type=Path)
    ap.add_argument("--readme", action="store_true", help="also update README.md's results section")
    args = ap.parse_args(argv)

    records = load_records(args.results)
    table = markdown_table(records)
    header = "# Benchmark results\n\nGenerated by `scripts/make_results_table.py`; do not edit.\n\n"
    if args.table == "-":
        print(table)
    else:
        out = Path(args.table) if args.table else args.results / "README.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + table)
        print(f"wrote {out} ({len(records)} records)")
    # The chart and the README summary leave out block-size sweeps (tuning data, kept in the
    # full table above).
    headline = [r for r in records if not r["bench"].endswith("_sweep")]
    if headline:
        plot_records(headline, args.chart)
        print(f"wrote {args.chart}")
    else:
        print("no records: no chart drawn")
    if args.readme:
        chart = None
        if headline:
            chart = os.path.relpath(args.chart.resolve(), ROOT)
        update_readme(ROOT / "README.md", markdown_table(headline), chart)
        print("updated the results section of README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
