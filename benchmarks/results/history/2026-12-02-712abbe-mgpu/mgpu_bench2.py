"""Session 19, job 2: w_in less its b part, [12544, 2304], at M = 1 and 8, kernel time by
CUPTI only: the Triton gemv (the product's), the weight-as-A GEMV with an identity-wgmma
transpose (`gemv_wt_mgpu.py`), and session 19's first x-as-A GEMV (the first version of
`pallas_kernels/gemv_mgpu.py`, commit d4c7617) at tilings with fewer shared-memory bytes per CTA
than job 1's.

    python benchmarks/wip/mgpu_bench2.py --out OUT.json
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_gemv import SHAPES, _weights  # noqa: E402
from decode_profile import profile_case  # noqa: E402
from gemv_wt_mgpu import gemv_wt  # noqa: E402

from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import gemv_mgpu as MG  # noqa: E402


def variants():
    out = {"triton": G.proj}
    for bn, bk, st in ((64, 128, 4), (64, 128, 6), (64, 256, 4), (128, 128, 4)):
        out[f"wt bn={bn} bk={bk} st={st}"] = lambda x, w, c=(bn, bk, st): gemv_wt(
            x, w, block_n=c[0], block_k=c[1], steps=c[2]
        )
    for bn, bk, st in ((64, 64, 8), (64, 64, 4), (64, 128, 5)):
        bs = MG.MgpuGemvBlockSizes(block_n=bn, block_k=bk, steps=st)
        out[f"xa bn={bn} bk={bk} st={st}"] = lambda x, w, bs=bs: MG.gemv_mgpu(x, w, block_sizes=bs)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    n, d = SHAPES["w_in"]
    n -= 32  # 12544 = 196 x 64 rows: no ragged tile (w_in less its 32-row b part)
    ws = _weights(n, d, jnp.bfloat16)
    recs = []
    for label, step in variants().items():
        for m in (1, 8):
            rec = dict(weight="w_in", m=m, variant=label)
            try:
                x = jax.random.normal(jax.random.key(3 + m), (m, d), jnp.float32)
                x = x.astype(jnp.bfloat16)
                want = np.asarray(x, np.float64) @ np.asarray(ws[0], np.float64).T
                f = jax.jit(step)
                got = np.asarray(f(x, ws[0]))
                rec["max_rel_err"] = float(
                    np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want))
                )
                if m > 1:
                    one = np.asarray(f(x[:1], ws[0]))
                    rec["row0_bits_equal_m1"] = bool(
                        np.array_equal(one.view(np.uint16), got[:1].view(np.uint16))
                    )

                def chain(x, step=step):
                    for w in ws:
                        y = step(x, w)
                        x = x + (1e-3 * y[:, :1].astype(jnp.float32)).astype(x.dtype)
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
