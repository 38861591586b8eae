"""Session 21: o_proj [2304, 4096] at M = 1 and 8, kernel time by CUPTI: the Triton sweep
(`gemv._run`, split-D partial sums added by XLA) against the Mosaic GPU kernel with D split
across a cluster of 2, 4 (the default) and 8 CTAs, partial sums added in the first CTA's
shared memory. Each result is checked against the f64 product; run to run and M = 1 bits too.

    python benchmarks/wip/oproj_split.py --out OUT.json
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
from bench_gemv import SHAPES, _weights  # noqa: E402
from decode_profile import profile_case  # noqa: E402

from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import gemv_mgpu as MG  # noqa: E402


def variants():
    what = lambda m: ("gemv", (1, 1)) if m == 1 else ("gemv_batchm", (2, 64))  # noqa: E731
    out = {"triton": lambda x, w: G._run([x], [w], None, None, None, *what(x.shape[0]))[0]}
    for split in (2, 4, 8):
        for steps in (4, 6):
            bs = MG.MgpuGemvBlockSizes(split_k=split, steps=steps)
            out[f"mgpu split={split} steps={steps}"] = lambda x, w, bs=bs: MG.gemv_mgpu(
                x, w, block_sizes=bs
            )
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    n, d = SHAPES["o_proj"]
    ws = _weights(n, d, jnp.bfloat16)
    recs = []
    for label, step in variants().items():
        for m in (1, 8):
            rec = dict(weight="o_proj", m=m, variant=label)
            try:
                x = jax.random.normal(jax.random.key(3 + m), (m, d), jnp.float32)
                x = x.astype(jnp.bfloat16)
                want = np.asarray(x, np.float64) @ np.asarray(ws[0], np.float64).T
                f = jax.jit(step)
                got = np.asarray(f(x, ws[0]))
                rec["max_rel_err"] = float(
                    np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want))
                )
                rec["run_to_run_bits_equal"] = bool(
                    np.array_equal(np.asarray(f(x, ws[0])).view(np.uint16), got.view(np.uint16))
                )
                if m > 1:
                    one = np.asarray(f(x[:1], ws[0]))
                    rec["row0_bits_equal_m1"] = bool(
                        np.array_equal(one.view(np.uint16), got[:1].view(np.uint16))
                    )

                def chain(x, step=step):
                    for w in ws:
                        y = step(x, w)
                        nudge = (1e-3 * y.astype(jnp.float32)).astype(x.dtype)
                        x = x.at[:, : y.shape[1]].add(nudge)
                    return x

                prof = profile_case(chain, x + 0, 4)
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


if __name__ == "__main__":
    main()
