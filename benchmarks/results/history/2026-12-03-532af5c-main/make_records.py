"""Builds session 22's top-level records from the job folders (history/2026-12-03-*)."""
import json, glob, os
H = "benchmarks/results/history/2026-12-03-532af5c-main"
OLD_CORE = ("measured with the loop carrying the state only: XLA dropped the o_norm launch as "
            "unused (so the figure is the recurrent kernel, FLA's work, which dd8b4b7 makes explicit), "
            "and for xla also the read-out")
out = []
for job, sample in (("job2", "job 2 of session 22"), ("job3", "job 3 of session 22 (a second sample)")):
    for r in json.load(open(f"{H}/{job}_bench_decode.json")):
        r = dict(r)
        extra = sample
        if r["bench"] == "decode_core":
            extra += "; " + OLD_CORE
        r["note"] = (r.get("note", "") + ("; " if r.get("note") else "") + extra)
        out.append(r)
for r in json.load(open(f"{H}/job2_prof_core.json")):
    r = {k: v for k, v in r.items() if k not in ("kernels", "fla_kernels")}
    r["note"] += "; " + OLD_CORE.replace(", and for xla also the read-out", "")
    out.append(r)
for name, label in (("prof_b1", "pallas"), ("prof_b1_cmdbuf", "pallas (XLA command buffers, WHILE)")):
    for r in json.load(open(f"{H}/job2_{name}.json")):
        if "cmdbuf" in name:
            out.append(dict(bench="decode_profile", shape=r["shape"], backend=label, time_us=r["wall_us"],
                floor_us=19.4, baseline=None, note=f"wall {r['wall_us']} us per step (differential loop) "
                "with the while loop as one CUDA graph; CUPTI saw the graph's kernels once, so it gives "
                f"no per-step busy time; XLA_FLAGS={r.get('xla_flags','')!r}", date=r["date"],
                commit=r["commit"], device=r["device"], command=r["command"]))
            continue
        ks = ", ".join(f"{k['name']} {k['mean_us']} x {k['per_step']}" for k in r["kernels"])
        out.append(dict(bench="decode_profile", shape=r["shape"], backend=label, time_us=r["wall_us"],
            floor_us=19.4, baseline=None, note=f"CUPTI busy {r['busy_us']} us per step, span {r['span_us']}, "
            f"wall {r['wall_us']} (differential loop); kernels (mean us x per step): {ks}; XLA_FLAGS="
            f"{r.get('xla_flags','')!r}", date=r["date"], commit=r["commit"], device=r["device"], command=r["command"]))
json.dump(out, open("benchmarks/results/2026-12-03_h200_decode_s22.json", "w"), indent=1)
pre = json.load(open(f"{H}/job3_bench_prefill.json"))
json.dump(pre, open("benchmarks/results/2026-12-03_h200_prefill_core_s22.json", "w"), indent=1)
print(len(out), len(pre))
