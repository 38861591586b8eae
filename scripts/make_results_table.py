"""Renders the benchmark records (benchmarks/results/<bench>.json) as the README's results table,
the chart docs/results.png, and the stage table of docs/performance.md.

    .venv/bin/python scripts/make_results_table.py           # both tables + the chart
    .venv/bin/python scripts/make_results_table.py --print   # the tables on stdout, nothing written
    .venv/bin/python scripts/make_results_table.py --check   # exit 1 if a table is stale

Each file is a JSON list of records with the keys `bench, shape, backend, time_us, floor_us,
baseline ({name, time_us} or null), date, commit, device, command` (and optionally `note`,
`tokens_per_s`); the bench scripts keep the newest record of every (bench, shape, backend)
there (`benchmarks/common.py`). A table has one row per record, except a record whose figure
already shows as another row's peer (e.g. the xla backend beside the pallas one). The README
gets the block and the cores against their peers (`HEADLINE`) and the chart; docs/performance.md
gets every other bench (the stages alone). In each file the text between
`<!-- results:begin -->` and `<!-- results:end -->` is replaced.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
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
# Table order: the block, then its stages; benches not named here follow alphabetically.
BENCH_ORDER = (
    "prefill_core",
    "prefill_block",
    "decode",
    "decode_k",
    "decode_pool",
    "decode_core",
    "decode_core_device",
    "conv_decode",
    "gemv",
    "train_core",
    "train_block",
)

# The README's benches; the others go to docs/performance.md.
HEADLINE = (
    "prefill_core",
    "prefill_block",
    "prefill_packed_core",
    "decode_pool",
    "decode_k",
    "train_core",
    "train_block",
)

__all__ = [
    "load_records",
    "table_rows",
    "markdown_table",
    "plot_records",
    "case_label",
    "shape_str",
    "readme_section",
    "update_readme",
    "main",
]


def _natural(text: str) -> list:
    """Sort key that puts B=8 before B=64."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _order(rec: dict) -> tuple:
    bench = rec["bench"]
    rank = BENCH_ORDER.index(bench) if bench in BENCH_ORDER else len(BENCH_ORDER)
    return rank, bench, _natural(shape_str(rec["shape"])), rec["backend"]


def load_records(results_dir: str | os.PathLike) -> list[dict]:
    """Every record of every *.json file in `results_dir`, in table order.

    A file that is not JSON, or an entry that lacks a required key, is skipped with a warning on
    stderr naming the file and the missing keys.
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
    return sorted(records, key=_order)


def shape_str(shape) -> str:
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    if isinstance(shape, list | tuple):
        return "x".join(str(s) for s in shape)
    return str(shape)


def case_label(rec: dict) -> str:
    """`bench shape backend`, one line per case."""
    return f"{rec['bench']} [{shape_str(rec['shape'])}] {rec['backend']}"


def _peer_us(rec: dict) -> float | None:
    return (rec.get("baseline") or {}).get("time_us")


def table_rows(records: list[dict]) -> list[dict]:
    """The records with a figure, less those whose figure is another row's peer (same bench and
    shape, the other record's baseline time equal to this record's time)."""
    rows = [r for r in records if r["time_us"] is not None]
    peers = {(r["bench"], shape_str(r["shape"]), _peer_us(r)) for r in rows if _peer_us(r)}
    return [r for r in rows if (r["bench"], shape_str(r["shape"]), r["time_us"]) not in peers]


def _us(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _ratio(num, den) -> str:
    return "-" if not (num and den) else f"{num / den:.2f}×"


def markdown_table(records: list[dict]) -> str:
    """The results table of `table_rows(records)`, its notes below it; a line when empty."""
    rows = table_rows(records)
    if not rows:
        return (
            "No benchmark results yet: run `benchmarks/bench_*.py` on a GPU, then "
            "`scripts/make_results_table.py`.\n"
        )
    tokens = any("tokens_per_s" in r for r in rows)
    several = len({r["device"] for r in rows}) > 1  # then each row names its device
    head = ["bench", "shape", "backend", "ours (µs)", "peer", "peer (µs)", "ours / peer"]
    head += ["ours / floor"] + (["tokens/s"] if tokens else []) + ["date", "commit"]
    head += ["device"] if several else []
    align = ["---"] * 3 + ["---:", "---", "---:", "---:", "---:"] + (["---:"] if tokens else [])
    align += ["---", "---"] + (["---"] if several else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    notes: list[str] = []
    for r in rows:
        t, base = r["time_us"], r["baseline"] or {}
        ours = _us(t)
        if r.get("note"):
            if r["note"] not in notes:
                notes.append(r["note"])
            ours += f" ({notes.index(r['note']) + 1})"
        cells = [r["bench"], shape_str(r["shape"]), r["backend"], ours]
        cells += [base.get("name", "-"), _us(base.get("time_us"))]
        cells += [_ratio(t, base.get("time_us")), _ratio(t, r["floor_us"])]
        if tokens:
            tps = r.get("tokens_per_s")
            cells.append("-" if tps is None else f"{tps / 1e6:.2f}M")
        cells += [str(r["date"])[:10], str(r["commit"])[:7]]
        cells += [r["device"].removeprefix("NVIDIA ")] if several else []
        lines.append("| " + " | ".join(cells) + " |")
    devices = ", ".join(sorted({r["device"] for r in rows}))
    lines += [
        "",
        f"{devices}. Ours / peer below 1.00× is faster than the peer (timed in the same process, "
        "so on the same device); "
        "ours / floor is the distance to the bandwidth (or FLOP) floor.",
    ]
    lines += [""] * bool(notes) + [f"- ({i + 1}) {n}" for i, n in enumerate(notes)]
    return "\n".join(lines) + "\n"


def plot_records(records: list[dict], path: str | os.PathLike | None = None):
    """Horizontal bars per table row: our time, the floor and the peer (µs, log scale).

    Returns the matplotlib figure (None when there is nothing to draw); saves it when `path` is
    set.
    """
    rows = table_rows(records)
    if not rows:
        return None
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    fig, ax = plt.subplots(figsize=(11, 0.42 * n + 1.6))
    y = list(range(n))
    h = 0.27
    ours = [r["time_us"] for r in rows]
    floors = [r["floor_us"] or 0 for r in rows]
    peers = [_peer_us(r) or 0 for r in rows]
    ax.barh([i - h for i in y], ours, h, label="kda-jax", color="tab:blue")
    ax.barh(y, floors, h, label="floor", color="tab:gray")
    ax.barh([i + h for i in y], peers, h, label="peer", color="tab:orange")
    for i, r in enumerate(rows):
        if peers[i]:
            ax.text(peers[i], i + h, f" {r['baseline']['name']}", va="center", fontsize=6)
        if floors[i]:
            ax.text(ours[i], i - h, f" {ours[i] / floors[i]:.2f}× floor", va="center", fontsize=6)
    labels = [f"{r['bench']} {r['backend']}\n{shape_str(r['shape'])}" for r in rows]
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(ours + floors + peers) * 6)  # room for the labels
    ax.set_xlabel("time per call (µs, log scale)")
    dates = sorted({str(r["date"])[:10] for r in rows})
    devices = ", ".join(sorted({r["device"] for r in rows}))
    ax.set_title(f"{devices} | {dates[0]}" + (f" .. {dates[-1]}" if len(dates) > 1 else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.42 * n + 1.6)), ncol=3)
    fig.tight_layout()
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def readme_section(table: str, chart: str | None) -> str:
    """The text that goes between the README's markers."""
    body = "\n" + table.strip() + "\n"
    if chart:
        body += f"\n![benchmark results]({chart})\n"
    return body


def update_readme(readme: str | os.PathLike, section: str, check: bool = False) -> bool:
    """Replaces the README's results section with `section`; returns whether it changed. With
    `check` nothing is written."""
    path = Path(readme)
    text = path.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{path} lacks the markers {README_BEGIN} ... {README_END}")
    new = text[: start + len(README_BEGIN)] + section + text[end:]
    if not check and new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--results", default=ROOT / "benchmarks" / "results", type=Path)
    ap.add_argument("--chart", default=ROOT / "docs" / "results.png", type=Path)
    ap.add_argument("--readme", default=ROOT / "README.md", type=Path)
    ap.add_argument("--stages", default=ROOT / "docs" / "performance.md", type=Path)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--print", action="store_true", help="print the tables; write nothing")
    what.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    args = ap.parse_args(argv)

    records = load_records(args.results)
    headline = [r for r in records if r["bench"] in HEADLINE]
    stages = [r for r in records if r["bench"] not in HEADLINE]
    targets = [(args.readme, headline, True), (args.stages, stages, False)]
    if args.print:
        for path, recs, _ in targets:
            print(f"{path.name}:\n{markdown_table(recs)}")
        return 0
    stale = []
    for path, recs, with_chart in targets:
        chart = None
        if with_chart and table_rows(recs):
            chart = os.path.relpath(args.chart.resolve(), path.resolve().parent)
            if not args.check:
                plot_records(recs, args.chart)
                print(f"wrote {args.chart}")
        changed = update_readme(path, readme_section(markdown_table(recs), chart), args.check)
        rows = len(table_rows(recs))
        if args.check:
            print(f"{path.name}: {rows} rows, {'stale' if changed else 'current'}")
            stale += [path] if changed else []
        else:
            print(f"{path.name}: {rows} rows, {'updated' if changed else 'unchanged'}")
    return int(bool(stale))


if __name__ == "__main__":
    sys.exit(main())
