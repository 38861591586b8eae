"""CPU, interpret mode: how the bf16 core's error against the fp32 reference depends on where the
scan adds Delta's low bf16 part (its products with A for the output, with kg for the state).

    .venv/bin/python benchmarks/wip/scan_err.py T HEADS        (T=4096, 4 heads: ~2 min)

Session 14 (written for the next session's `scan_state_hi.patch`, which drops the low part from
the state update only). The kernel variants replace `chunk_scan._chunk_scan_kernel` in this
process; jax's caches are cleared between them.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
jax.config.update("jax_platforms", "cpu")

import test_chunk as tc  # noqa: E402

import pallas_kernels.chunk_scan as cs  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402
from pallas_kernels.chunk import prefill_core  # noqa: E402

f32 = jnp.float32
NT = (((1,), (1,)), ((), ()))  # x @ y.T
TN = (((0,), (0,)), ((), ()))  # x.T @ y


def variant(lo_in_o: bool, lo_in_s: bool):
    """The scan kernel with Delta's low part in the output's and/or the state's product."""

    def kernel(qg_ref, kg_ref, w_ref, u_ref, a_ref, gl_ref, s_ref, o_ref, s_out_ref, *, chunk):
        mm = qg_ref.dtype

        def step(n, s_t):
            rows = pl.ds(n * chunk, chunk)
            s_mm = s_t.astype(mm)
            w_s = lax.dot_general(w_ref[rows, :], s_mm, NT, preferred_element_type=f32)
            delta = u_ref[rows, :].astype(f32) - w_s
            hi = delta.astype(mm)
            lo = (delta - hi.astype(f32)).astype(mm)
            a, kg = a_ref[rows, :], kg_ref[rows, :]
            o = lax.dot_general(qg_ref[rows, :], s_mm, NT, preferred_element_type=f32)
            o += jnp.dot(a, hi, preferred_element_type=f32)
            s_t = gl_ref[pl.ds(n, 1), :] * s_t + lax.dot_general(
                hi, kg, TN, preferred_element_type=f32
            )
            if lo_in_o:
                o += jnp.dot(a, lo, preferred_element_type=f32)
            if lo_in_s:
                s_t += lax.dot_general(lo, kg, TN, preferred_element_type=f32)
            o_ref[rows, :] = o.astype(o_ref.dtype)
            return s_t

        s_t = lax.fori_loop(0, gl_ref.shape[0], step, s_ref[...].astype(f32).T)
        s_out_ref[...] = s_t.T

    return kernel


def rel_rms(x, y) -> float:
    x, y = jnp.asarray(x, f32), jnp.asarray(y, f32)
    return float(jnp.sqrt(jnp.mean((x - y) ** 2) / jnp.mean(y**2)))


def main():
    t, h, kd = int(sys.argv[1]), int(sys.argv[2]), 128
    variants = {"both": (True, True), "o_only": (True, False), "s_only": (False, True)}
    variants["none"] = (False, False)
    for decay in ("weak", "moderate"):
        inp = tc._inputs(
            jax.random.key(3), b=1, t=t, h=h, kd=kd, dtype=jnp.bfloat16, decay=decay, lengths=[t]
        )
        kw = dict(scale=kd**-0.5, chunk=32, lower_bound=-5.0, eps=tc.EPS)
        y_ref, s_ref = ref.prefill_core_reference(*inp, **kw, out_dtype=f32)
        for name, (lo_o, lo_s) in variants.items():
            cs._chunk_scan_kernel = variant(lo_o, lo_s)
            jax.clear_caches()
            y, s = prefill_core(*inp, **kw, out_dtype=jnp.bfloat16)
            print(
                f"T={t} heads={h} {decay:9s} low part in {name:7s}: rel RMS y "
                f"{rel_rms(y, y_ref):.3e}, state {rel_rms(s, s_ref):.3e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
