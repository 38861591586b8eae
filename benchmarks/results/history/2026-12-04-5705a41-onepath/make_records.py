"""Builds session 24's top-level records from its three job folders; run from the repo root:

.venv/bin/python benchmarks/results/history/2026-12-04-5705a41-onepath/make_records.py
"""

import json

from kda_jax.config import preset

HIST = "benchmarks/results/history"
PDL = f"{HIST}/2026-12-04-0bf5ead-pdl"
PAIR = f"{HIST}/2026-12-04-ba23b3d-pairwise"
ONE = f"{HIST}/2026-12-04-5705a41-onepath"
OUT_DECODE = "benchmarks/results/2026-12-04_h200_decode_pdl_s24.json"
OUT_PREFILL = "benchmarks/results/2026-12-04_h200_prefill_core_s24.json"
BANDWIDTH = 4.3e12  # B/s, as bench_decode.py
CFG = preset("kimi-linear-48b")


def _load(path):
    with open(path) as fh:
        return json.load(fh)


def _floor_us(shape):
    """The decode floor of a decode_profile shape ("B=1", "B=1,k=8"): weights once, the state
    read once and written once per row (the verify's snapshots)."""
    fields = dict(kv.split("=") for kv in shape.split(","))
    b, k = int(fields["B"]), int(fields.get("k", 1))
    return round((CFG.weight_bytes() + (1 + k) * b * CFG.state_bytes()) / BANDWIDTH * 1e6, 2)


def _pdl(flags):
    return "on" if "enable_pdl=true" in flags else "off"


def decode_records():
    out = []
    for name in ("prof_off", "prof_on"):
        for r in _load(f"{PDL}/{name}.json"):
            pdl = _pdl(r["xla_flags"])
            ks = ", ".join(f"{k['name']} {k['mean_us']}" for k in r["kernels"])
            rec = dict(
                bench=r["bench"],
                shape=r["shape"],
                backend=f"pallas, PDL {pdl} (CUPTI span)",
                time_us=r["span_us"],
                floor_us=_floor_us(r["shape"]),
                baseline=None,
                **{k: r[k] for k in ("date", "commit", "device", "command")},
            )
            rec["note"] = (
                f"device span per step (first kernel's start to last kernel's end, CUPTI) with "
                f"XLA's programmatic dependent launch {pdl}; busy {r['busy_us']} us, wall "
                f"{r['wall_us']} (differential loop, no profiler); kernels (mean us, once per "
                f"step): {ks}; XLA_FLAGS={r['xla_flags']!r}"
            )
            out.append(rec)
    for name in ("stack_off", "stack_on"):
        for r in _load(f"{PDL}/{name}.json"):
            pdl = _pdl(r.pop("xla_flags"))
            r["backend"] = f"pallas, PDL {pdl}"
            r["note"] = (
                "wall clock per block per step of a jitted loop over a stack of `layers` blocks "
                f"(distinct weights and states; benchmarks/wip/stack_decode.py); XLA's "
                f"programmatic dependent launch {pdl}"
            )
            out.append(r)
    return out


def prefill_records():
    out = []
    for r in _load(f"{ONE}/pf_core.json"):
        r["note"] = "chunk_prepare with one path for both gates (5705a41), FLA timed beside it"
        out.append(r)
    for name, what in (
        ("pf_base", "the bounded gate's factorised prepare path (main before 5705a41)"),
        ("pf_pairwise", "the bounded gate through the pairwise path (force_pairwise.patch)"),
    ):
        for r in _load(f"{PAIR}/{name}.json"):
            r["backend"] = f"{r['backend']} [{name[3:]}]"
            r["note"] = f"{what}; one process per tree, FLA timed beside each case"
            out.append(r)
    return out


def main():
    for path, recs in ((OUT_DECODE, decode_records()), (OUT_PREFILL, prefill_records())):
        with open(path, "w") as fh:
            json.dump(recs, fh, indent=1)
        print(f"wrote {len(recs)} records to {path}")


if __name__ == "__main__":
    main()
