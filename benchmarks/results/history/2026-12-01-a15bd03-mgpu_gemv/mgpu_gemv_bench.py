"""Session 11 experiment: a Mosaic GPU GEMV (TMA-pipelined weight tiles, wgmma with the weight
as the 64-row A operand and x padded to 8 rows as B) against the Triton gemv and XLA's dot at
M = 1, same loop and method as bench_gemv.py (rotating weight copies, dependent calls).

    python benchmarks/wip/mgpu_gemv_bench.py --out OUT.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_gemv import SHAPES, _weights, time_calls  # noqa: E402
from decode_profile import profile_case  # noqa: E402
from gemv_mgpu import gemv_t  # noqa: E402

from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

R = 8


def mgpu_step(cfg):
    bn, bk, steps, split = cfg

    def step(x, w):  # x [1, D] -> y [1, N] fp32, via x padded to 8 rows
        x8 = jnp.zeros((R, x.shape[1]), jnp.bfloat16).at[:1].set(x.astype(jnp.bfloat16))
        part = gemv_t(x8, w, block_n=bn, block_k=bk, steps=steps, split=split)
        return jnp.sum(part, axis=0)[:, :1].T

    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    recs = []
    configs = {
        "w_in": [
            (64, 128, 4, 1),
            (64, 128, 6, 1),
            (64, 256, 4, 1),
            (64, 128, 4, 2),
            (64, 128, 4, 3),
            (64, 256, 3, 3),
            (128, 128, 4, 1),
            (64, 128, 4, 9),
        ],
        "o_proj": [
            (64, 128, 4, 4),
            (64, 128, 4, 8),
            (64, 256, 4, 8),
            (64, 128, 4, 16),
            (64, 256, 4, 16),
            (128, 128, 4, 8),
        ],
    }
    for name, (n, d) in SHAPES.items():
        if name not in configs:
            continue
        ws = _weights(n, d, jnp.bfloat16)
        x = jax.random.normal(jax.random.key(3), (1, d), jnp.float32).astype(jnp.bfloat16)
        want = ref.gemv_reference(x, ws[0].astype(jnp.float32), out_dtype=jnp.float32)
        floor = n * d * 2 / 4.3e12 * 1e6
        variants = {
            "triton": lambda x, w: G.gemv(x, w, out_dtype=jnp.float32),
            "xla": lambda x, w: ref.gemv_reference(x, w, out_dtype=jnp.float32),
        }
        for cfg in configs[name]:
            variants["mgpu bn={} bk={} st={} split={}".format(*cfg)] = mgpu_step(cfg)
        for label, step in variants.items():
            try:
                got = jax.jit(step)(x, ws[0])
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                t = time_calls(step, x, ws, 20e-6, 0.05, 5) * 1e6

                def chain(x, step=step, ws=ws):
                    for w in ws:
                        y = step(x, w)
                        x = x + (1e-3 * y[:, :1].astype(jnp.float32)).astype(x.dtype)
                    return x

                prof = profile_case(chain, x + 0, 4)
                kern = [
                    (k["name"][:40], k["per_step"] / len(ws), k["mean_us"]) for k in prof["kernels"]
                ]
                rec = dict(
                    weight=name,
                    variant=label,
                    time_us=round(t, 2),
                    floor_us=round(floor, 2),
                    max_rel_err=err,
                    busy_per_call_us=round(prof["busy_us"] / len(ws), 2),
                    kernels=kern,
                )
            except Exception as e:  # noqa: BLE001
                rec = dict(weight=name, variant=label, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    with open(args.out, "w") as fh:
        json.dump(recs, fh, indent=1)


if __name__ == "__main__":
    main()
