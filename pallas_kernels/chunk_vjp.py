"""The chunked core with a VJP on Pallas kernels: what the pallas backend trains through.

Forward (per chunk, G the chunk-local cumsum of g, as `reference._chunk_local`):

    A = s S(q, k; G)   M = I + beta S_strict(k, k; G)   T = M^-1   w, u = T beta [k exp(G), v]
    then `chunk_scan` (saving the state S_n before each chunk and Delta_n)

with the decayed scores on `chunk_scores`' kernel and T by `reference.unit_lower_solve`'s
doubling. Saved: the chunked inputs, G, T, S_strict(k, k), the scan's intermediates, S_n and
Delta_n. Backward, with L_n = dLoss/dS_n+1 (L_N-1 = the final state's cotangent), the only
serial part is one walk over the chunks in reverse (`_chunk_scan_bwd_kernel`), one program per
(sequence, head, V tile) with L's tile in registers (held transposed, as the forward holds S):

    E_n   = A_n^T dO_n + kg_n L_n                   [C, BV]  (dLoss/dDelta_n = dLoss/du_n)
    L_n-1 = gl_n L_n + qg_n^T dO_n - w_n^T E_n      [K, BV]  (L_-1 = the initial state's)

then one program per (sequence, head, chunk) forms every gradient of the chunk but the scores'
(`_local_bwd_kernel`): the products with S_n and L_n that give d qg = dO S^T, d w = -E S^T,
d kg = Delta L^T, d A = dO Delta^T and d exp(G_last) = sum_v S * L; back through w, u = T rhs
(d rhs = T^T [dw, du], dM = -strict_lower(d rhs [w, u]^T)); the elementwise gates; it writes
dA and dS_strict. Then one program per (sequence, head, chunk, K slice) adds the decayed
scores' VJPs (`_scores_bwd_kernel`), the same 16-row walk as `chunk_scores`' (every exponent
<= 0, any decay strength) and turns dG into dg (its reverse cumsum over the chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels import reference as ref
from pallas_kernels.chunk_prepare import ChunkIntermediates
from pallas_kernels.chunk_scan import ScanBlockSizes, chunk_scan
from pallas_kernels.chunk_scores import SUB, block_k, chunk_scores, k_slices, scores_grads

__all__ = ["chunk_kda_vjp"]

f32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # x @ y.T
_TN = (((0,), (0,)), ((), ()))  # x.T @ y
_BLOCK_V = 32  # V slices of the backward kernel (its K slices: chunk_scores.block_k)
_SCORES_BWD_WARPS = 4  # one [C, 32] slice per program


def _dot(x, y, dims=None):
    if dims is None:
        return jnp.dot(x, y, preferred_element_type=f32)
    return lax.dot_general(x, y, dims, preferred_element_type=f32)


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


def _scan_bwd(qg, kg, w, a, gl, do, ds, blk: ScanBlockSizes, interpret: bool):
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


def _local_bwd_kernel(
    q_ref,  # [C, K] q (unscaled)
    k_ref,  # [C, K]
    v_ref,  # [C, V]
    gc_ref,  # [C, K] G, the chunk-local cumsum of g
    beta_ref,  # [C]
    t_ref,  # [C, C] T = M^-1
    skk_ref,  # [C, C] S_strict(k, k)
    hs_ref,  # [K, V] S_n, the state before the chunk
    lam_ref,  # [K, V] L_n = dLoss/dS_n+1
    delta_ref,  # [C, V]
    e_ref,  # [C, V] dLoss/dDelta_n
    do_ref,  # [C, V] (read from [B, N*C, H, V])
    dq_ref,  # [C, K]
    dk_ref,  # [C, K]
    dv_ref,  # [C, V]
    dgc_ref,  # [C, K] dLoss/dG
    dbeta_ref,  # [C]
    ds_ref,  # [C, 2C] dLoss/dS of the two score matrices, for `_scores_bwd_kernel`
    dst_ref,  # [C, 2C] their transposes
    *,
    scale: float,
):
    c, kd = q_ref.shape
    vd = v_ref.shape[1]
    bk, bv = block_k(kd), min(_BLOCK_V, vd)
    tm = t_ref[...]
    bcol = beta_ref[...][:, None]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    last = lax.broadcasted_iota(jnp.int32, (c, bk), 0) == c - 1

    def v_slice(j, acc):  # the V side: dA, dv, and dM and dbeta through u = T beta v
        da, dm, dbeta = acc
        vv = pl.ds(pl.multiple_of(j * bv, bv), bv)
        v, e = v_ref[:, vv], e_ref[:, vv]
        da += _dot(do_ref[:, vv], delta_ref[:, vv], _NT)
        drhs_v = _dot(tm, e, _TN)  # T^T du
        dm += _dot(drhs_v, _dot(tm, bcol * v), _NT)  # d rhs_v u^T
        dv_ref[:, vv] = bcol * drhs_v
        return da, dm, dbeta + jnp.sum(drhs_v * v, axis=1)

    zc = jnp.zeros((c, c), f32)
    da, dm, dbeta = lax.fori_loop(0, vd // bv, v_slice, (zc, zc, jnp.zeros((c,), f32)))

    def k_slice(kk, acc):  # everything else but the scores' VJPs, by K slices
        dm, dbeta = acc

        def products(j, acc):  # the products with S_n and L_n over V
            dqg, dw, dkg, dgl = acc
            vv = pl.ds(pl.multiple_of(j * bv, bv), bv)
            s_n, lam = hs_ref[kk, vv], lam_ref[kk, vv]
            dqg += _dot(do_ref[:, vv], s_n, _NT)
            dw -= _dot(e_ref[:, vv], s_n, _NT)
            dkg += _dot(delta_ref[:, vv], lam, _NT)
            return dqg, dw, dkg, dgl + jnp.sum(s_n * lam, axis=1)

        zk = jnp.zeros((c, bk), f32)
        dqg, dw, dkg, dgl = lax.fori_loop(
            0, vd // bv, products, (zk, zk, zk, jnp.zeros((bk,), f32))
        )
        q, k, g = q_ref[:, kk], k_ref[:, kk], gc_ref[:, kk]
        g_last = gc_ref[pl.ds(c - 1, 1), kk]  # [1, BK]
        eg, el = jnp.exp(g), jnp.exp(g_last - g)
        kg, ke = k * el, k * eg
        drhs_k = _dot(tm, dw, _TN)  # T^T dw
        dm += _dot(drhs_k, _dot(tm, bcol * ke), _NT)  # d rhs_k w^T
        dbeta += jnp.sum(drhs_k * ke, axis=1)
        dgl_last = jnp.sum(kg * dkg, axis=0) + jnp.exp(g_last[0]) * dgl  # dLoss/dG_last
        dq_ref[:, kk] = scale * eg * dqg
        dk_ref[:, kk] = el * dkg + bcol * eg * drhs_k
        dgc = scale * q * eg * dqg - kg * dkg + bcol * ke * drhs_k
        dgc_ref[:, kk] = dgc + jnp.where(last, dgl_last[None, :], 0.0)
        return dm, dbeta

    dm, dbeta = k_slices(kd, k_slice, (dm, dbeta))
    dm = jnp.where(cols < rows, -dm, 0.0)
    dbeta_ref[...] = dbeta + jnp.sum(dm * skk_ref[...], axis=1)
    ds_a, ds_k = jnp.where(cols <= rows, scale * da, 0.0), bcol * dm
    ds_ref[:, pl.ds(0, c)] = ds_a
    ds_ref[:, pl.ds(c, c)] = ds_k
    dst_ref[:, pl.ds(0, c)] = ds_a.T
    dst_ref[:, pl.ds(c, c)] = ds_k.T


def _scores_bwd_kernel(ds_ref, dst_ref, q_ref, k_ref, gc_ref, dq_ref, dk_ref, dgc_ref, dq_out,
                       dk_out, dg_out):  # fmt: skip
    """One (sequence, head, chunk, K slice): the two score matrices' VJPs added to the partial
    dq, dk, dG of `_local_bwd_kernel`, then dg from dG (G = cumsum g: dg is dG's reverse
    cumsum over the chunk). Every gradient is elementwise in K once dS is known, so the 16-row
    walks split over K slices into short programs (the walk is latency-bound)."""
    c, bk = q_ref.shape
    kk = pl.ds(0, bk)
    dxq, dyq = scores_grads(ds_ref, dst_ref, 0, q_ref, k_ref, gc_ref, kk, False)
    dxk, dyk = scores_grads(ds_ref, dst_ref, c, k_ref, k_ref, gc_ref, kk, True)
    i = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    suffix = jnp.where(lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1) >= i, 1.0, 0.0)
    later = jnp.zeros((1, bk), f32)  # dG summed over the rows below this block
    for bi in reversed(range(c // SUB)):
        r = pl.ds(bi * SUB, SUB)
        q, k = q_ref[r, :], k_ref[r, :]
        dq_out[r, :] = dq_ref[r, :] + dxq[bi]
        dk_out[r, :] = dk_ref[r, :] + dyq[bi] + dxk[bi] + dyk[bi]
        dgc = dgc_ref[r, :] + q * dxq[bi] + k * (dxk[bi] - dyq[bi] - dyk[bi])
        hi = lax.Precision.HIGHEST  # IEEE fp32: a sum, not a TF32 product
        dg_out[r, :] = jnp.dot(suffix, dgc, precision=hi, preferred_element_type=f32) + later
        later += jnp.sum(dgc, axis=0, keepdims=True)


def _local_bwd(q, k, v, gc, beta, tm, skk, hs, lam, delta, e, do, *, scale, interpret):
    """Every gradient of the intra-chunk stage; inputs [B, H, N*C, .] (beta [B, H, N*C], the
    states [B, H, N, K, V], do [B, N*C, H, V]); returns dq, dk, dv, dg, dbeta [B, H, N*C, .]."""
    bsz, h, tp, kd = q.shape
    vd, n = v.shape[-1], hs.shape[2]
    c = tp // n

    def rows(d):
        return pl.BlockSpec((None, None, c, d), lambda s, hh, i: (s, hh, i, 0))

    vec = pl.BlockSpec((None, None, c), lambda s, hh, i: (s, hh, i))
    state = pl.BlockSpec((None, None, None, kd, vd), lambda s, hh, i: (s, hh, i, 0, 0))
    shape = lambda d: jax.ShapeDtypeStruct((bsz, h, tp, d), f32)  # noqa: E731
    dq, dk, dv, dgc, dbeta, ds, dst = pl.pallas_call(
        functools.partial(_local_bwd_kernel, scale=scale),
        out_shape=(
            shape(kd),
            shape(kd),
            shape(vd),
            shape(kd),
            jax.ShapeDtypeStruct((bsz, h, tp), f32),
            shape(2 * c),
            shape(2 * c),
        ),
        grid=(bsz, h, n),
        in_specs=[
            rows(kd),
            rows(kd),
            rows(vd),
            rows(kd),
            vec,
            rows(c),
            rows(c),
            state,
            state,
            rows(vd),
            rows(vd),
            pl.BlockSpec((None, c, None, vd), lambda s, hh, i: (s, i, hh, 0)),
        ],
        out_specs=(rows(kd), rows(kd), rows(vd), rows(kd), vec, rows(2 * c), rows(2 * c)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name="kda_chunk_local_bwd",
        interpret=interpret,
    )(q, k, v, gc, beta, tm, skk, hs, lam, delta, e, do)
    bk = block_k(kd)
    part = pl.BlockSpec((None, None, c, bk), lambda s, hh, i, j: (s, hh, i, j))
    dq, dk, dg = pl.pallas_call(
        _scores_bwd_kernel,
        out_shape=(shape(kd),) * 3,
        grid=(bsz, h, n, kd // bk),
        in_specs=[pl.BlockSpec((None, None, c, 2 * c), lambda s, hh, i, j: (s, hh, i, 0))] * 2
        + [part] * 6,
        out_specs=(part,) * 3,
        input_output_aliases={5: 0, 6: 1, 7: 2},
        compiler_params=plt.CompilerParams(num_warps=_SCORES_BWD_WARPS, num_stages=1),
        name="kda_chunk_scores_bwd",
        interpret=interpret,
    )(ds, dst, q, k, gc, dq, dk, dgc)
    return dq, dk, dv, dg, dbeta


def _forward(scale, chunk, t, interpret, q, k, v, g, beta, state):
    b, _, h, kd = q.shape
    xs = tuple(ref._to_chunks(a, chunk) for a in (q, k, v, g, beta))  # [B, H, N, C, .]
    qc, kc, vc, gc, bc = xs
    gc = jnp.cumsum(gc, axis=-2)
    a, skk = chunk_scores(qc, kc, gc, interpret=interpret)
    a = scale * a
    tm = ref._unit_lower_inverse(jnp.eye(chunk, dtype=f32) + bc[..., None] * skk)
    solve = functools.partial(jnp.einsum, "...ij,...jn->...in", tm, precision=lax.Precision.HIGHEST)
    flat = lambda x: x.reshape(b, h, -1, *x.shape[4:])  # noqa: E731 - [B, H, N*C, .]
    qg, kg, w, u, gl = ref.chunk_terms(qc, kc, vc, gc, bc, scale, solve)
    inter = ChunkIntermediates(qg=flat(qg), kg=flat(kg), w=flat(w), u=flat(u), a=flat(a), gl=gl)
    o, new_state, hs, delta = chunk_scan(
        inter, state, t=t, out_dtype=f32, save_states=True, interpret=interpret
    )
    saved = (inter.qg, inter.kg, inter.w, inter.a, inter.gl)  # what the reverse pass reads
    res = tuple(map(flat, (qc, kc, vc, gc, bc, tm, skk))) + (saved, hs, delta)
    return (o, new_state), res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _core(scale, chunk, t, interpret, q, k, v, g, beta, state):
    return _forward(scale, chunk, t, interpret, q, k, v, g, beta, state)[0]


def _core_bwd(scale, chunk, t, interpret, res, cts):
    qc, kc, vc, gc, bc, tm, skk, saved, hs, delta = res
    do, ds = cts
    bsz, h, tp, kd = qc.shape
    vd = vc.shape[-1]
    do = jnp.pad(do.astype(f32), [(0, 0), (0, tp - t), (0, 0), (0, 0)])  # rows past T: no output
    blk = ScanBlockSizes.get_default(bsz, h, vd, chunk)
    e, lam, dh0 = _scan_bwd(*saved, do, ds.astype(f32), blk, interpret)
    dq, dk, dv, dg, dbeta = _local_bwd(
        qc, kc, vc, gc, bc, tm, skk, hs, lam, delta, e, do, scale=scale, interpret=interpret
    )
    back = lambda x: jnp.moveaxis(x, 1, 2)[:, :t]  # noqa: E731 - [B, T, H, .]
    return back(dq), back(dk), back(dv), back(dg), back(dbeta), dh0


_core.defvjp(lambda *a: _forward(*a), _core_bwd)


def chunk_kda_vjp(q, k, v, g, beta, state, *, scale: float, chunk: int,
                  interpret: bool | None = None):  # fmt: skip
    """`reference.chunk_kda_reference` (same arguments and pad rules, fp32) on the Pallas
    kernels, with a VJP to q, k, v, g, beta and the state. Returns (o [B, T, H, V] fp32,
    new_state [B, H, K, V] fp32)."""
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    for name, x in args.items():
        if x.dtype != f32:
            raise ValueError(f"chunk_kda_vjp: {name} is {x.dtype}, expected float32")
    kd, vd = q.shape[-1], v.shape[-1]
    for name, n in (("chunk", chunk), ("K", kd), ("V", vd)):
        if n < SUB or n & (n - 1):
            raise ValueError(f"chunk_kda_vjp: {name}={n}; expected a power of two >= {SUB}")
    t = q.shape[1]
    return _core(float(scale), int(chunk), t, common.resolve_interpret(interpret), *args.values())
