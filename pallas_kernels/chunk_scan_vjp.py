"""The chunked core's state pass with a VJP: `chunk_scan` forward, a reverse-time kernel back.

Forward, per chunk n from state S_n (what `chunk_scan` computes, in fp32):

    Delta_n = u_n - w_n S_n      O_n = qg_n S_n + A_n Delta_n      S_n+1 = gl_n S_n + kg_n^T Delta_n

It also saves S_n and Delta_n. Backward, with L_n = dLoss/dS_n+1 (L_N-1 = the final state's
cotangent), the only serial part is one walk over the chunks in reverse, one program per
(sequence, head, V tile) with L's tile in registers (held transposed, as the forward holds S):

    E_n   = A_n^T dO_n + kg_n L_n                   [C, BV]  (dLoss/dDelta_n = du_n)
    L_n-1 = gl_n L_n + qg_n^T dO_n - w_n^T E_n      [K, BV]  (L_-1 = the initial state's)

Every other gradient is a batched product over all chunks at once, left to XLA:
dqg = dO S^T, dA = dO Delta^T, dw = -E S^T, dkg = Delta L^T, dgl = sum_v S * L.
Saved for the backward: S and L at each chunk start (fp32, [B, H, N, K, V]: K*V*4/C bytes a token
and head, 2 KiB at C = 32) and Delta (V*4 bytes a token and head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.chunk_prepare import ChunkIntermediates
from pallas_kernels.chunk_scan import ScanBlockSizes, chunk_scan

__all__ = ["chunk_scan_vjp", "scan_bwd"]

f32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # x @ y.T
_TN = (((0,), (0,)), ((), ()))  # x.T @ y


def _chunk_scan_bwd_kernel(qg_ref, kg_ref, w_ref, a_ref, gl_ref, do_ref, ds_ref, e_ref, lam_ref,
                           dh0_ref, *, chunk: int):  # fmt: skip
    """One (sequence, head, V tile): the chunks in reverse, L^T [BV, K] in registers."""
    n_chunks = gl_ref.shape[0]

    def step(i, lam_t):
        n = n_chunks - 1 - i
        rows = pl.ds(n * chunk, chunk)
        lam_ref[n] = lam_t.T
        do = do_ref[rows, :].astype(f32)  # [C, BV]
        e = lax.dot_general(a_ref[rows, :], do, _TN, preferred_element_type=f32)
        e += lax.dot_general(kg_ref[rows, :], lam_t, _NT, preferred_element_type=f32)
        e_ref[rows, :] = e
        lam_t = gl_ref[pl.ds(n, 1), :] * lam_t
        lam_t += lax.dot_general(do, qg_ref[rows, :], _TN, preferred_element_type=f32)
        lam_t -= lax.dot_general(e, w_ref[rows, :], _TN, preferred_element_type=f32)
        return lam_t

    lam_t = lax.fori_loop(0, n_chunks, step, ds_ref[...].astype(f32).T)
    dh0_ref[...] = lam_t.T


def scan_bwd(qg, kg, w, a, gl, do, ds, blk: ScanBlockSizes, interpret: bool):
    """(E [B, H, N*C, V], L [B, H, N, K, V], dS_0 [B, H, K, V]) from dO [B, N*C, H, V]."""
    bsz, h, tp, kd = qg.shape
    vd, n = do.shape[-1], gl.shape[2]
    chunk, bv = tp // n, blk.block_v
    whole = lambda d: pl.BlockSpec((None, None, tp, d), lambda s, hh, j: (s, hh, 0, 0))  # noqa: E731
    tile = pl.BlockSpec((None, None, kd, bv), lambda s, hh, j: (s, hh, 0, j))
    return pl.pallas_call(
        functools.partial(_chunk_scan_bwd_kernel, chunk=chunk),
        out_shape=(
            jax.ShapeDtypeStruct((bsz, h, tp, vd), f32),
            jax.ShapeDtypeStruct((bsz, h, n, kd, vd), f32),
            jax.ShapeDtypeStruct((bsz, h, kd, vd), f32),
        ),
        grid=(bsz, h, vd // bv),
        in_specs=[
            whole(kd),
            whole(kd),
            whole(kd),
            whole(chunk),
            pl.BlockSpec((None, None, n, kd), lambda s, hh, j: (s, hh, 0, 0)),
            pl.BlockSpec((None, tp, None, bv), lambda s, hh, j: (s, 0, hh, j)),
            tile,
        ],
        out_specs=(
            pl.BlockSpec((None, None, tp, bv), lambda s, hh, j: (s, hh, 0, j)),
            pl.BlockSpec((None, None, n, kd, bv), lambda s, hh, j: (s, hh, 0, 0, j)),
            tile,
        ),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        name="kda_chunk_scan_bwd",
        interpret=interpret,
    )(qg, kg, w, a, gl, do, ds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan(t, interpret, qg, kg, w, u, a, gl, state):
    o, new_state = chunk_scan(
        ChunkIntermediates(qg, kg, w, u, a, gl), state, t=t, out_dtype=f32, interpret=interpret
    )
    return o, new_state


def _scan_fwd(t, interpret, qg, kg, w, u, a, gl, state):
    inter = ChunkIntermediates(qg, kg, w, u, a, gl)
    o, new_state, hs, delta = chunk_scan(
        inter, state, t=t, out_dtype=f32, save_states=True, interpret=interpret
    )
    return (o, new_state), (qg, kg, w, a, gl, hs, delta)


def _scan_bwd_rule(t, interpret, res, cts):
    qg, kg, w, a, gl, hs, delta = res
    do, ds = cts
    bsz, h, tp, kd = qg.shape
    n, vd = gl.shape[2], do.shape[-1]
    chunk = tp // n
    do = jnp.pad(do.astype(f32), [(0, 0), (0, tp - t), (0, 0), (0, 0)])  # rows past T: no output
    blk = ScanBlockSizes.get_default(bsz, h, vd, chunk)
    e, lam, dh0 = scan_bwd(qg, kg, w, a, gl, do, ds.astype(f32), blk, interpret)
    chunks = lambda x: x.reshape(bsz, h, n, chunk, x.shape[-1])  # noqa: E731
    do_c = jnp.moveaxis(do.reshape(bsz, n, chunk, h, vd), 3, 1)  # [B, H, N, C, V]
    e_c, delta_c = chunks(e), chunks(delta)
    flat = lambda x: x.reshape(bsz, h, tp, x.shape[-1])  # noqa: E731
    by_state = functools.partial(jnp.einsum, "bhncv,bhnkv->bhnck")
    dqg = flat(by_state(do_c, hs))
    dw = -flat(by_state(e_c, hs))
    dkg = flat(by_state(delta_c, lam))
    da = flat(jnp.einsum("bhniv,bhnjv->bhnij", do_c, delta_c))
    dgl = jnp.sum(hs * lam, axis=-1)
    return dqg, dkg, dw, e, da, dgl, dh0


_scan.defvjp(_scan_fwd, _scan_bwd_rule)


def chunk_scan_vjp(qg, kg, w, u, a, gl, state, *, t: int, interpret: bool | None = None):
    """`reference.chunk_scan_reference` (same arguments, fp32) on the Pallas kernels, with a VJP
    to every input: the state pass the pallas backend's backward runs. Returns
    (o [B, T, H, V] fp32, new_state [B, H, K, V] fp32)."""
    for name, x in zip("qg kg w u a gl state".split(), (qg, kg, w, u, a, gl, state), strict=True):
        if x.dtype != f32:
            raise ValueError(f"chunk_scan_vjp: {name} is {x.dtype}, expected float32")
    return _scan(t, common.resolve_interpret(interpret), qg, kg, w, u, a, gl, state)
