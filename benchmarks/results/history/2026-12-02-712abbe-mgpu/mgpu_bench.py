"""Session 19 experiment: the Mosaic GPU GEMV (`pallas_kernels/gemv_mgpu.py`, x as wgmma's A
operand, y stored as [M, N]) against the Triton gemv at M = 1, 8, 64 on w_in (its four parts)
and o_proj, several tilings. Per variant: max relative error against an fp32 product, row 0's
bits at M = 8 and 64 against M = 1, wall clock per call (bench_gemv's rotating-weight loop) and
CUPTI kernel time per call.

    python benchmarks/wip/mgpu_bench.py --out OUT.json
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_gemv import SHAPES, _weights, time_calls  # noqa: E402
from decode_profile import profile_case  # noqa: E402

from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import gemv_mgpu as MG  # noqa: E402

SPLITS = {"w_in": (12288, 128, 128, 32), "o_proj": None}
MG_CFGS = {
    "w_in": [
        (64, 128, 4, 1),
        (64, 128, 6, 1),
        (64, 256, 3, 1),
        (32, 128, 4, 1),
        (128, 128, 4, 1),
        (64, 128, 4, 2),
    ],
    "o_proj": [
        (64, 128, 4, 16),
        (64, 128, 4, 8),
        (64, 128, 4, 4),
        (64, 256, 4, 8),
        (32, 128, 4, 8),
        (128, 128, 4, 16),
    ],
}


def first(y):
    return y[0] if isinstance(y, tuple) else y


def cat(y):
    return jnp.concatenate(y, axis=1) if isinstance(y, tuple) else y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,8,64")
    args = p.parse_args()
    recs = []
    for name in ("w_in", "o_proj"):
        n, d = SHAPES[name]
        splits = SPLITS[name]
        ws = _weights(n, d, jnp.bfloat16)
        floor = n * d * 2 / 4.3e12 * 1e6
        for m in (int(v) for v in args.rows.split(",")):
            x = jax.random.normal(jax.random.key(3 + m), (m, d), jnp.float32).astype(jnp.bfloat16)
            want = np.asarray(x, np.float64) @ np.asarray(ws[0], np.float64).T
            variants = {"triton": lambda x, w, splits=splits: G.proj(x, w, splits=splits)}
            for c in MG_CFGS[name]:
                bs = MG.MgpuGemvBlockSizes(block_n=c[0], block_k=c[1], steps=c[2], split_d=c[3])
                variants["mgpu bn={} bk={} st={} split={}".format(*c)] = (
                    lambda x, w, bs=bs, splits=splits: MG.gemv_mgpu(
                        x, w, splits=splits, block_sizes=bs
                    )
                )
            for label, step in variants.items():
                rec = dict(weight=name, m=m, variant=label, floor_us=round(floor, 2))
                try:
                    got = np.asarray(cat(jax.jit(step)(x, ws[0])), np.float64)
                    rec["max_rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    if m > 1:
                        one = np.asarray(cat(jax.jit(step)(x[:1], ws[0])))
                        rec["row0_bits_equal_m1"] = bool(
                            np.array_equal(
                                one.view(np.uint16),
                                np.asarray(cat(jax.jit(step)(x, ws[0])))[:1].view(np.uint16),
                            )
                        )
                    rec["time_us"] = round(
                        time_calls(first_step(step), x, ws, 20e-6, 0.05, 5) * 1e6, 2
                    )

                    def chain(x, step=step, ws=ws):
                        for w in ws:
                            y = first(step(x, w))
                            x = x + (1e-3 * y[:, :1].astype(jnp.float32)).astype(x.dtype)
                        return x

                    prof = profile_case(chain, x + 0, 4)
                    rec["busy_per_call_us"] = round(prof["busy_us"] / len(ws), 2)
                    rec["kernels"] = [
                        (k["name"][:40], round(k["per_step"] / len(ws), 2), k["mean_us"])
                        for k in prof["kernels"]
                    ]
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                print(json.dumps(rec), flush=True)
                recs.append(rec)
                with open(args.out, "w") as fh:
                    json.dump(recs, fh, indent=1)


def first_step(step):
    return lambda x, w: first(step(x, w))


if __name__ == "__main__":
    main()
