"""Would o_proj's GEMV run from L2 if its weight were read ahead, while the decode step's
latency-bound kernels (decode_front, recurrent, o_norm: ~7 us at B=1) leave HBM idle?

One jitted loop per variant, each step: flush L2 (XLA reads 128 MB), [touch o_proj's weight: a
kernel that reads every byte of it once with the given eviction policy and stores one sum per
program], then the o_proj GEMV (proj at M=1, default tiling). CUPTI device time per kernel name
(torch.profiler), printed and written as JSON to --out.

    python benchmarks/wip/l2_touch.py --out PATH
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pallas_kernels.gemv import proj  # noqa: E402


def _touch_kernel(w_ref, o_ref, *, rows_per, block_d, d, policy):
    i = pl.program_id(0)
    r0 = i * rows_per

    def step(j, acc):
        k0 = pl.multiple_of(j * block_d, block_d)
        t = plt.load(w_ref.at[pl.ds(r0, rows_per), pl.ds(k0, block_d)], eviction_policy=policy)
        return acc + t.astype(jnp.float32)

    acc = lax.fori_loop(0, d // block_d, step, jnp.zeros((rows_per, block_d), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=1, keepdims=True).T  # [1, rows_per]


def touch(w, *, programs, policy, num_stages=4, block_d=256):
    n, d = w.shape
    rows_per = n // programs
    return pl.pallas_call(
        functools.partial(_touch_kernel, rows_per=rows_per, block_d=block_d, d=d, policy=policy),
        out_shape=jax.ShapeDtypeStruct((programs, rows_per), jnp.float32),
        grid=(programs,),
        out_specs=pl.BlockSpec((1, rows_per), lambda i: (i, 0)),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=num_stages),
        name="kda_touch",
        interpret=jax.default_backend() != "gpu",
    )(w)


def profile(step, carry, n=20):
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    loop = jax.jit(lambda c: lax.fori_loop(0, n, lambda i, c: step(c), c))
    for _ in range(2):
        carry = jax.block_until_ready(loop(carry))
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        carry = jax.block_until_ready(loop(carry))
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as dd:
        path = os.path.join(dd, "t.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            ev = json.load(fh)["traceEvents"]
    by = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") == "kernel" and "dur" in e:
            by[e["name"][:60]].append(float(e["dur"]))
    return {k: dict(per_step=len(v) / n, mean_us=round(sum(v) / len(v), 2)) for k, v in by.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    key = jax.random.key(0)
    w_o = (jax.random.normal(key, (2304, 4096), jnp.float32) * 0.02).astype(jnp.bfloat16)
    big = jnp.ones((32 * 1024 * 1024,), jnp.float32)  # 128 MB: more than the 50 MB L2
    y0 = jax.random.normal(jax.random.key(1), (1, 4096), jnp.float32).astype(jnp.bfloat16)

    def make(variant):
        def step(c):
            y, acc = c
            f = jnp.sum(big)  # evicts what L2 held
            y = y + (f * 1e-30).astype(y.dtype)
            if variant is not None:
                policy, programs = variant
                t = touch(w_o, programs=programs, policy=policy)
                y = y + (t[0, 0] * 1e-30).astype(y.dtype)
            out = proj(y, w_o)
            return y, acc + out[0, 0].astype(jnp.float32)

        return step

    res = {}
    variants = {
        "base": None,
        "touch_last_144": ("evict_last", 144),
        "touch_normal_144": (None, 144),
        "touch_last_288": ("evict_last", 288),
        "touch_last_576": ("evict_last", 576),
    }
    for name, v in variants.items():
        try:
            res[name] = profile(make(v), (y0, jnp.zeros((), jnp.float32)))
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=repr(e)[:400])
        print(name, json.dumps(res[name]), flush=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
