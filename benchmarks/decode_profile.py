"""Where a decode step's time goes: the kernels one step launches, each one's device time, and the
step's wall time, on one GPU.

The jitted decode loop of bench_decode.py (n dependent steps in one `fori_loop`, state donated)
runs once under torch.profiler, which records every kernel of the process through CUPTI, XLA's
included; the Chrome trace is read back and its kernels grouped by name. Per case it prints and
records: kernels per step, the sum of their device times per step ("busy"), the device span
from the first kernel's start to the last one's end per step ("span"), and the loop's wall time
per step measured without the profiler, differentially as bench_decode.py does ("wall").
span - busy is the gaps between kernels; wall - span what the host adds per step.

    python benchmarks/decode_profile.py [--out PATH] [--n 20] [--cases decode:1,core:8,...]

The `core:B` cases put the decode core's device time per step beside the device time per call
of FLA's `fused_recurrent_kda` kernels on inputs of the same shapes (both from CUPTI): the
like-for-like comparison at small B, where bench_decode's wall-clock figures are too noisy.
Their records also carry the results table's keys (bench `decode_core_device`, backend,
time_us = busy per step, floor_us as bench_decode's decode core, baseline = FLA's busy per call).
Without --out those are merged into benchmarks/results/decode_core_device.json and the other
cases are printed only; --out PATH writes every record of the run to PATH instead.
`--reformat SAVED` adds those keys to the core records of a file saved before they existed and
writes them to --out (nothing is re-measured).

Run it again under another XLA_FLAGS (e.g. command buffers for while loops) to compare; the
flags in force are recorded.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_decode import (  # noqa: E402
    FLA_NAME,
    _core_inputs,
    _decode_k_step,
    _decode_step,
    _pallas_core_step,
    core_carry,
    core_floor_us,
    core_kwargs,
    fla_core_call,
    random_state,
)

from kda_jax.config import preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402
from pallas_kernels.recurrent import RecurrentBlockSizes  # noqa: E402


def _kernels(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel in a Chrome trace."""
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    return [
        (e["name"], float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("cat") == "kernel" and "dur" in e
    ]


def profile_case(step, carry, n: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    loop = jax.jit(lambda c: lax.fori_loop(0, n, lambda i, c: step(c), c), donate_argnums=0)
    for _ in range(2):
        carry = jax.block_until_ready(loop(carry))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        carry = jax.block_until_ready(loop(carry))
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        kernels = _kernels(path)
    wall = common.time_loop(step, carry, n, 5, differential=True)
    by_name = collections.defaultdict(list)
    for name, _, dur in kernels:
        by_name[name].append(dur)
    rows = sorted(
        ((name[:90], len(d) / n, sum(d) / len(d)) for name, d in by_name.items()),
        key=lambda r: -r[1] * r[2],
    )
    span = (max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)) if kernels else 0
    return dict(
        kernels_per_step=round(len(kernels) / n, 2),
        busy_us=round(sum(d for _, _, d in kernels) / n, 2),
        span_us=round(span / n, 2),
        wall_us=round(wall, 2),
        kernels=[dict(name=r[0], per_step=round(r[1], 2), mean_us=round(r[2], 2)) for r in rows],
    )


def table_keys(rec: dict, cfg) -> dict:
    """The results table's keys for a core record (shape "B=..,block_v=..[,warps=..]")."""
    fields = dict(kv.split("=") for kv in rec["shape"].split(","))
    b = int(fields["B"])
    # Records saved before the shape named the warps say the V tile only (the warps were the
    # default of the tree that ran them).
    tile = ",".join(f"{k}={fields[k]}" for k in ("block_v", "warps") if k in fields)
    # Shapes only: nothing is allocated (this runs on the GPU right after a measurement).
    acts, _, state = jax.eval_shape(
        lambda: _core_inputs(b, cfg.heads, cfg.head_dim, jax.random.key(b))
    )
    fla = rec.get("fla_busy_us")
    return dict(
        bench="decode_core_device",
        shape=f"B={b},H={cfg.heads},K={cfg.head_dim},R=1",
        backend=f"pallas[{tile}]",
        time_us=rec["busy_us"],
        floor_us=round(core_floor_us(acts, state), 2),
        baseline=None if fla is None else dict(name=f"{FLA_NAME} (CUPTI)", time_us=fla),
        note="device time (CUPTI): kernels per step, the benchmark loop's add included; FLA's "
        "kernels per call, its fill included",
        profile_shape=rec["shape"],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        help="write every record here (default: the core records merged into "
        "benchmarks/results/decode_core_device.json, the rest printed)",
    )
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument(
        "--cases",
        default="decode:1,decode:64,decode_k:8",
        help="comma-separated decode:B, decode_k:k (at B=1) or core:B[:BV[:WARPS]] (the decode "
        "core, default tiling or V tile BV with WARPS warps, with FLA's fused_recurrent_kda "
        "kernels on inputs of the same shapes beside it)",
    )
    parser.add_argument(
        "--reformat", metavar="SAVED", help="add the table keys to SAVED's core records; no run"
    )
    args = parser.parse_args()
    cfg = preset("kimi-linear-48b")
    if args.reformat:
        if not args.out:
            parser.error("--reformat needs --out")
        with open(args.reformat) as fh:
            saved = json.load(fh)
        out = [{**r, **table_keys(r, cfg)} for r in saved if r["bench"] == "core_profile"]
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {len(out)} core records to {args.out}")
        return
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    meta = common.meta()
    meta["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    out = []
    for case in args.cases.split(","):
        what, num, *tile = case.split(":")
        num = int(num)
        if tile and what != "core":
            parser.error(f"--cases {case!r}: only core:B takes a V tile (core:B:BV[:WARPS])")
        key = jax.random.key(num)
        extra = {}  # the core's FLA beside it
        if what == "core":  # one launch per step: its device time against FLA's per call
            acts, core_params, state = _core_inputs(num, cfg.heads, cfg.head_dim, key)
            block = RecurrentBlockSizes.get_default(num, cfg.heads, cfg.head_dim, cfg.head_dim)
            if tile:  # core:B:BV[:WARPS] overrides the default tiling
                block = RecurrentBlockSizes.with_block_v(cfg.head_dim, int(tile[0]))
                if len(tile) > 1:
                    block = RecurrentBlockSizes(block.block_v, int(tile[1]))
            step = functools.partial(
                _pallas_core_step, acts, core_params, core_kwargs(cfg), cfg.l2_eps, block
            )
            carry = core_carry(acts, state)
            shape = f"B={num},block_v={block.block_v},warps={block.num_warps}"
            try:
                fla = common.torch_kernels(fla_core_call(num, cfg.heads, cfg.head_dim), 20)
                extra = dict(fla_busy_us=round(sum(r[1] for r in fla), 2), fla_kernels=fla)
            except Exception as e:  # noqa: BLE001 - reported in the record
                extra = dict(fla_error=f"{type(e).__name__}: {e}"[:400])
        elif what == "decode":
            x = jax.random.normal(key, (num, cfg.hidden), jnp.float32).astype(params.dtype)
            step, carry = _decode_step(params, cfg, "pallas"), (x, random_state(cfg, num, key))
            shape = f"B={num}"
        else:
            x = jax.random.normal(key, (1, num, cfg.hidden), jnp.float32).astype(params.dtype)
            step, carry = _decode_k_step(params, cfg), (x, random_state(cfg, 1, key))
            shape = f"B=1,k={num}"
        try:
            rec = dict(bench=f"{what}_profile", shape=shape, **profile_case(step, carry, args.n))
            rec.update(extra)
            if what == "core":
                rec.update(table_keys(rec, cfg))
        except Exception as e:  # noqa: BLE001 - reported in the record
            rec = dict(bench=f"{what}_profile", shape=shape, error=f"{type(e).__name__}: {e}"[:400])
        rec.update(meta)
        out.append(rec)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)
        elif rec["bench"] == "decode_core_device":
            common.merge_results([rec])
        print(json.dumps({k: v for k, v in rec.items() if "kernels" not in k}), flush=True)
        for r in rec.get("kernels", []):
            print(f"   {r['per_step']:6.2f} x {r['mean_us']:8.2f} us  {r['name']}", flush=True)


if __name__ == "__main__":
    main()
