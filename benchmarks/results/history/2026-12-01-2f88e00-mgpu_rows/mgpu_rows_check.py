"""Session 11: the Mosaic GPU GEMV reading x at M rows (8-row TMA boxes past the array's end)
and storing y [M, N] through a transposed view of its shared-memory tile: right at M = 1, 3, 8?
Kernel time at M = 1 against the Triton gemv (same loop as bench_gemv.py).

    python benchmarks/wip/mgpu_rows_check.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_gemv import _weights, time_calls  # noqa: E402
from gemv_mgpu_rows import gemv2  # noqa: E402

from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

n, d = 12288, 2304  # w_in's q|k|v rows: a multiple of the 64-row tile
ws = _weights(n, d, jnp.bfloat16)
for m in (1, 3, 8):
    x = jax.random.normal(jax.random.key(m), (m, d), jnp.float32).astype(jnp.bfloat16)
    want = ref.gemv_reference(x, ws[0], out_dtype=jnp.float32)
    got = jax.jit(lambda x, w: gemv2(x, w, out_dtype=jnp.float32))(x, ws[0])
    tri = G.proj(x, ws[0], out_dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    print(
        f"M={m}: mgpu max rel err {float(jnp.max(jnp.abs(got - want))) / scale:.2e}, "
        f"triton {float(jnp.max(jnp.abs(tri - want))) / scale:.2e}",
        flush=True,
    )
x = jax.random.normal(jax.random.key(0), (1, d), jnp.float32).astype(jnp.bfloat16)
for label, step in (
    ("triton", lambda x, w: G.gemv(x, w)),
    ("mgpu", lambda x, w: gemv2(x, w)),
):
    print(f"{label}: {time_calls(step, x, ws, 20e-6, 0.05, 5) * 1e6:.2f} us/call", flush=True)
