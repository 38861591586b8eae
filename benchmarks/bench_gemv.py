"""Times the decode projections: Pallas gemv / gemv_batchm against XLA's dot, at the block's shapes.

Shapes (bf16 weights, Kimi-Linear geometry): w_in [12576, 2304] (58 MB), o_proj [2304, 4096]
(18.9 MB), f_b [4096, 128] (1 MB); M = 1, 2, 4, 8 activation rows, and 64 (decode at B = 64,
the kernel's tiling for 9..64 rows). The floor is the weight bytes
over the device's copy bandwidth (`common.bandwidth`); effective TB/s = weight bytes / time.

Method: one jit runs a `fori_loop` (static trip count) whose body makes at least 16 projection
calls, each fed the previous call's x perturbed by its output (x += 1e-3 * y[:, :1]), so calls are
dependent and none can be skipped or merged. Weight copies rotate through the calls (160 MB in
all, above the L2, capped at 64 copies: f_b's 64 MB then sit near the L2 size, so its figure is
partly L2-served); every other weight is streamed from HBM on every call. Time = median wall time of
the whole loop / number of calls, after a warm-up. Each call also pays the small perturbation
fusion; `loop_overhead_us` (the same loop with an identity in place of the projection) estimates
that share and is reported beside the figures, never subtracted from them. The XLA baseline is
`reference.gemv_reference`, the `xla` backend's projection (cuBLAS / XLA's GEMV emitter).

Usage (on the GPU):
  python benchmarks/bench_gemv.py [--quick] [--out PATH]  # merged into benchmarks/results/gemv.json
  python benchmarks/bench_gemv.py --sweep --out sweep.json   # block sizes on w_in, o_proj
  python benchmarks/bench_gemv.py --sweep --sweep-rows 64 --out sweep64.json  # ... at M = 64
  python benchmarks/bench_gemv.py --sweep --deep --sweep-rows 1,8 --out deep.json  # deeper
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

L2_ROTATION_BYTES = 160e6
MAX_COPIES = 64
SHAPES = {"w_in": (12576, 2304), "o_proj": (2304, 4096), "f_b": (4096, 128)}


def _commit() -> str:
    if os.environ.get("KDA_COMMIT"):
        return os.environ["KDA_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parents[1],
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _weights(n: int, d: int, dtype) -> tuple[jax.Array, ...]:
    nbytes = n * d * jnp.dtype(dtype).itemsize
    copies = min(MAX_COPIES, max(2, math.ceil(L2_ROTATION_BYTES / nbytes)))
    keys = jax.random.split(jax.random.key(1), copies)
    return tuple((d**-0.5 * jax.random.normal(k, (n, d), jnp.float32)).astype(dtype) for k in keys)


def time_calls(step, x, ws, est_s: float, target_s: float, reps: int) -> float:
    """Median seconds per call of `step(x, w) -> y [M, N]` over dependent, rotating calls.

    The loop body unrolls at least 16 calls (cycling through the weight copies) and the trip
    count is static (sized from `est_s`, a guess of one call's time), so XLA's while-loop
    bookkeeping is shared by many calls.
    """
    per_iter = len(ws) * math.ceil(16 / len(ws))
    iters = max(2, math.ceil(target_s / (per_iter * est_s)))

    @jax.jit
    def run(x, ws):
        def body(_, x):
            for i in range(per_iter):
                y = step(x, ws[i % len(ws)])
                x = x + (1e-3 * y[:, :1].astype(jnp.float32)).astype(x.dtype)
            return x

        return lax.fori_loop(0, iters, body, x)

    run(x, ws).block_until_ready()  # compile and warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run(x, ws)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
    assert bool(jnp.all(jnp.isfinite(out))), "timed loop produced non-finite values"
    return statistics.median(times) / (iters * per_iter)


def _identity(x, w):
    del w
    return lax.optimization_barrier(x)  # keeps one perturbation fusion per "call"


def _record(args, device, bench, shape, backend, t, floor, baseline, **extra):
    return dict(
        bench=bench,
        shape=shape,
        backend=backend,
        time_us=round(t * 1e6, 3),
        floor_us=round(floor * 1e6, 3),
        baseline=baseline,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=args.commit,
        device=device,
        command=common.command(),
        **extra,
    )


def main_cases(args, device, target_s, reps):
    ms = (1, 8, 64) if args.quick else (1, 2, 4, 8, 64)
    key = jax.random.key(0)
    records, rows = [], []
    overhead = {}
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(key, m), (m, 2304), jnp.float32).astype(
            jnp.bfloat16
        )
        overhead[m] = time_calls(_identity, x, (jnp.zeros(()),), 2e-6, target_s, reps)
    for name, (n, d) in SHAPES.items():
        ws = _weights(n, d, jnp.bfloat16)
        nbytes = n * d * 2
        floor = nbytes / common.bandwidth()
        est = max(floor, 3e-6)
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, d), jnp.float32).astype(
                jnp.bfloat16
            )
            kernel = G.gemv if m == 1 else G.gemv_batchm
            t_xla = time_calls(ref.gemv_reference, x, ws, est, target_s, reps)
            t_pk = time_calls(kernel, x, ws, est, target_s, reps)
            shape = f"{name} [{n}, {d}] bf16, M={m}"
            shared = dict(
                tbps=None,
                weight_bytes=nbytes,
                copies=len(ws),
                loop_overhead_us=round(overhead[m] * 1e6, 3),
            )
            xla_rec = _record(args, device, "gemv", shape, "xla_dot", t_xla, floor, None, **shared)
            xla_rec["tbps"] = round(nbytes / t_xla / 1e12, 3)
            pk_rec = _record(
                args,
                device,
                "gemv",
                shape,
                "pallas",
                t_pk,
                floor,
                dict(name="xla_dot", time_us=round(t_xla * 1e6, 3)),
                **shared,
            )
            pk_rec["tbps"] = round(nbytes / t_pk / 1e12, 3)
            pk_rec["block_sizes"] = dataclasses.asdict(G.GemvBlockSizes.get_default(n, d, m))
            records += [pk_rec, xla_rec]
            rows.append((shape, t_pk, t_xla, floor, nbytes, overhead[m]))
    print(
        f"\n{'case':38s} {'pallas us':>10s} {'TB/s':>6s} {'xla us':>9s} {'TB/s':>6s} "
        f"{'floor us':>9s} {'loop ovh us':>11s}"
    )
    for shape, t_pk, t_xla, floor, nbytes, ovh in rows:
        print(
            f"{shape:38s} {t_pk * 1e6:10.2f} {nbytes / t_pk / 1e12:6.2f} {t_xla * 1e6:9.2f} "
            f"{nbytes / t_xla / 1e12:6.2f} {floor * 1e6:9.2f} {ovh * 1e6:11.2f}"
        )
    return records


def _candidates(name: str, m: int, deep: bool = False):
    """(block_n, block_d, warps, stages, split) candidates for a weight at M rows; `deep`: the
    deeper pipelines and 512-column slices of the deep sweep (more weight bytes in flight per
    program: o_proj at M = 1 unsplit or split 2-4, which the first sweep only took to 4
    stages; w_in with 64-row tiles)."""
    if deep:
        if name == "w_in":  # also 64-row tiles, which re-read x half as often at M = 8
            return itertools.product((32, 64), (128, 256, 512), (4,), (4, 6), (1,))
        if m > 1:
            return iter(())
        return itertools.product((16, 32), (256, 512), (4,), (6, 8), (1, 2, 4))
    if m > G.MAX_KERNEL_ROWS:  # an activation tile of up to 64 rows: narrower slices, wider rows
        splits = (1, 2, 3) if name == "w_in" else (1, 2, 4)
        return itertools.product((32, 64, 128), (64, 128), (4, 8), (3,), splits)
    # w_in (17.8 us for a 13.5 us read in the decode step, 2026-12-01): also more warps, deeper
    # pipelines and a few D splits (more programs in flight per SM).
    splits = (1, 2, 3) if name == "w_in" else (1, 2, 4, 8)
    warps_list, stages_list = ((4, 8), (3, 4, 6)) if name == "w_in" else ((4,), (3, 4))
    return itertools.product((16, 32, 64), (128, 256), warps_list, stages_list, splits)


def sweep_cases(args, device, target_s, reps):
    """Times every block-size candidate on w_in and o_proj at each M of --sweep-rows, with XLA's
    dot beside each (same loop, same weights)."""
    key = jax.random.key(0)
    records, rows = [], []
    for name in ("w_in", "o_proj"):
        n, d = SHAPES[name]
        ws = _weights(n, d, jnp.bfloat16)
        floor = n * d * 2 / common.bandwidth()
        for m in args.sweep_rows:
            x = jax.random.normal(key, (m, d), jnp.float32).astype(jnp.bfloat16)
            fn = G.gemv if m == 1 else G.gemv_batchm
            t_xla = time_calls(ref.gemv_reference, x, ws, max(floor, 3e-6), target_s, reps)
            shape = f"{name} [{n}, {d}] M={m}, xla dot"
            rec = _record(args, device, "gemv_sweep", shape, "xla_dot", t_xla, floor, None)
            records.append(rec)
            rows.append((shape, t_xla, floor))
            for bn, bd, warps, stages, split in _candidates(name, m, args.deep):
                if (d // bd) % split:
                    continue
                bs = G.GemvBlockSizes(bn, bd, warps, stages, split)
                step = lambda x, w, bs=bs, fn=fn: fn(x, w, block_sizes=bs)  # noqa: E731
                try:
                    t = time_calls(step, x, ws, max(floor, 3e-6), target_s, reps)
                except Exception as e:  # a candidate that does not compile is reported
                    print(f"{name} M={m} {bs}: failed: {type(e).__name__}: {e}"[:300])
                    continue
                shape = f"{name} [{n}, {d}] M={m}, {bn}x{bd} w{warps} s{stages} split{split}"
                rec = _record(
                    args,
                    device,
                    "gemv_sweep",
                    shape,
                    "pallas",
                    t,
                    floor,
                    None,
                    block_sizes=dataclasses.asdict(bs),
                    tbps=round(n * d * 2 / t / 1e12, 3),
                )
                records.append(rec)
                rows.append((shape, t, floor))
                print(f"{shape:60s} {t * 1e6:8.2f}", flush=True)  # a cut run keeps its lines
    print(f"\n{'case':60s} {'us':>8s} {'TB/s':>6s} {'floor':>7s}")
    for shape, t, floor in sorted(rows, key=lambda r: (r[0].split(",")[0], r[1])):
        print(f"{shape:60s} {t * 1e6:8.2f} {floor * 4.3 / t:6.2f} {floor * 1e6:7.2f}")
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="write the JSON list of records here (default: merge the main cases into "
        "benchmarks/results/gemv.json; a sweep is saved only with --out)",
    )
    parser.add_argument("--quick", action="store_true", help="M = 1, 8 and 64 only, shorter loops")
    parser.add_argument("--sweep", action="store_true", help="time block-size candidates instead")
    parser.add_argument(
        "--sweep-rows",
        type=lambda v: tuple(int(m) for m in v.split(",")),
        default=(1,),
        help="comma-separated M values to sweep (default 1)",
    )
    parser.add_argument(
        "--deep", action="store_true", help="with --sweep: the deep-pipeline candidates"
    )
    args = parser.parse_args()
    args.commit = _commit()
    device = jax.devices()[0].device_kind
    if jax.default_backend() != "gpu":
        print(
            f"warning: running on {device} ({jax.default_backend()}): kernels are interpreted, "
            "the figures mean nothing",
            file=sys.stderr,
        )
    target_s, reps = (0.005, 3) if args.quick else (0.02, 5)
    if args.sweep:
        records = sweep_cases(args, device, target_s / 2, 3)
    else:
        records = main_cases(args, device, target_s, reps)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(records, indent=1))
        print(f"wrote {len(records)} records to {args.out}")
    elif not args.sweep:
        for path in common.merge_results(records):
            print(f"merged {len(records)} records into {path.relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
