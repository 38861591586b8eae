"""Builds session 22's top-level records from this folder's job files; run from the repo root:

python3 benchmarks/results/history/2026-12-03-532af5c-main/make_records.py
"""

import json

H = "benchmarks/results/history/2026-12-03-532af5c-main"
OUT = "benchmarks/results/2026-12-03_h200_decode_s22.json"
OUT_PREFILL = "benchmarks/results/2026-12-03_h200_prefill_core_s22.json"
OLD_CORE = (
    "measured with the loop carrying the state only: XLA dropped the o_norm launch as unused (so "
    "the figure is the recurrent kernel, FLA's work, which dd8b4b7 makes explicit)"
)
FLOOR_B1 = 19.4  # bench_decode's floor of the B=1 step (its decode records)


def _load(name):
    with open(f"{H}/{name}.json") as fh:
        return json.load(fh)


def _noted(rec, *notes):
    return {**rec, "note": "; ".join(n for n in (rec.get("note"), *notes) if n)}


def main():
    out = []
    for job, sample in (("job2", "job 2 of session 22"), ("job3", "job 3 of session 22")):
        for r in _load(f"{job}_bench_decode"):
            if r["bench"] == "decode_core":
                extra = OLD_CORE + ("; for xla also the read-out" if r["backend"] == "xla" else "")
                out.append(_noted(r, sample, extra))
            else:
                out.append(_noted(r, sample))
    for r in _load("job2_prof_core"):
        out.append(_noted({k: v for k, v in r.items() if "kernels" not in k}, OLD_CORE))
    for name, label in (("prof_b1", "pallas"), ("prof_b1_cmdbuf", "pallas (command buffers)")):
        for r in _load(f"job2_{name}"):
            if "cmdbuf" in name:
                note = (
                    f"wall {r['wall_us']} us per step (differential loop), the while loop as "
                    "one CUDA graph; CUPTI saw the graph's kernels once, so no per-step busy "
                    "time"
                )
            else:
                ks = ", ".join(f"{k['name']} {k['mean_us']}" for k in r["kernels"])
                note = (
                    f"CUPTI busy {r['busy_us']} us per step, span {r['span_us']}, wall "
                    f"{r['wall_us']} (differential loop); kernels (mean us, once per step): {ks}"
                )
            keep = {k: r[k] for k in ("date", "commit", "device", "command")}
            rec = dict(bench="decode_profile", shape=r["shape"], backend=label)
            rec.update(time_us=r["wall_us"], floor_us=FLOOR_B1, baseline=None, **keep)
            rec["note"] = f"{note}; XLA_FLAGS={r.get('xla_flags', '')!r}"
            out.append(rec)
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1)
    with open(OUT_PREFILL, "w") as fh:
        json.dump(_load("job3_bench_prefill"), fh, indent=1)
    print(f"wrote {len(out)} records to {OUT} and the prefill core's to {OUT_PREFILL}")


if __name__ == "__main__":
    main()
