"""Decayed scores of whole chunks on the Triton backend: what the training path's forward forms
its intra-chunk stage with (the reference is `reference._chunk_scores`), and the walk its
backward kernels (`chunk_vjp`) run for their gradients.

    S_ij = sum_k x_ik y_jk exp(g_ik - g_jk)  for j <= i (j < i if strict), else 0      [C, C]

g is a chunk-local cumsum of log-decays (non-increasing along C), so exp(g_i - g_j) <= 1 where
S is formed, but exp(g_i) alone may overflow (the unbounded gate). The forward forms both of
the core's matrices, A = S(q, k) and S_strict(k, k), in one program per (chunk, 16-row block):
a block below the diagonal factors through the block's first row r, exp(g_i - g_r)
exp(g_r - g_j) with both exponents <= 0, into one [16, K] x [K, 16] product per matrix (the
k-side factor shared); the diagonal block is formed column by column, its exponents masked to
-inf above the diagonal before the exp. The gradients are the same walk (`scores_grads`: dx,
dy, and dg = x dx - y dy), over K slices, since every gradient is elementwise in K once dS is
known.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

__all__ = ["SUB", "block_k", "chunk_scores", "k_slices", "scores_grads"]

f32 = jnp.float32
SUB = 16  # rows of a sub-block: the smallest Triton dot side
_NT = (((1,), (1,)), ((), ()))  # x @ y.T
_TN = (((0,), (0,)), ((), ()))  # x.T @ y
_WARPS = 2  # the forward's programs: one 16-row block each
_BLOCK_K = 32  # K slice of the VJP's programs and of the forward's loop (K itself if smaller)


def _diag_exponent(g_a, g_b, j: int, strict: bool, below: bool = True):
    """g_a - g_b on a sub-block's rows i for its row j (one of g_a, g_b is that row [1, K]),
    -inf outside the kept triangle: below, i >= j (i > j if strict); else i <= j (i < j)."""
    i = lax.broadcasted_iota(jnp.int32, jnp.broadcast_shapes(g_a.shape, g_b.shape), 0)
    if below:
        keep = i > j if strict else i >= j
    else:
        keep = i < j if strict else i <= j
    return jnp.where(keep, g_a - g_b, -jnp.inf)


def block_k(kd: int) -> int:
    """Width of the K slices every kernel of the training core loops over."""
    return min(_BLOCK_K, kd)


def k_slices(kd: int, body, carry):
    """`carry = body(kk, carry)` over the K slices kk (a pl.ds of `block_k(kd)` columns), as a
    rolled loop: unrolled, the kernels' Triton IR (and its compile time) grows with K."""
    bk = block_k(kd)

    def step(i, carry):
        return body(pl.ds(pl.multiple_of(i * bk, bk), bk), carry)

    return lax.fori_loop(0, kd // bk, step, carry)


def _scores_kernel(q_ref, k_ref, g_ref, a_ref, s_ref):
    """Row block bi (program axis 1) of one chunk's S(q, k) and S_strict(k, k)."""
    c, kd = q_ref.shape
    bi = pl.program_id(1)
    r0 = pl.multiple_of(bi * SUB, SUB)
    rows = pl.ds(r0, SUB)
    col = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    zero = jnp.zeros((SUB, SUB), f32)

    def below(bj, carry):  # a block left of the diagonal, factored through row r0
        cols = pl.ds(pl.multiple_of(bj * SUB, SUB), SUB)

        def k_slice(kk, acc):
            g_r = g_ref[pl.ds(r0, 1), kk]
            e_ir = jnp.exp(g_ref[rows, kk] - g_r)
            y_r = k_ref[cols, kk] * jnp.exp(g_r - g_ref[cols, kk])
            a = lax.dot_general(q_ref[rows, kk] * e_ir, y_r, _NT, preferred_element_type=f32)
            s = lax.dot_general(k_ref[rows, kk] * e_ir, y_r, _NT, preferred_element_type=f32)
            return acc[0] + a, acc[1] + s

        a_ref[:, cols], s_ref[:, cols] = k_slices(kd, k_slice, (zero, zero))
        return carry

    lax.fori_loop(0, bi, below, 0)

    def k_slice(kk, acc):  # the diagonal block, by its columns j
        q_i, k_i, g_i = q_ref[rows, kk], k_ref[rows, kk], g_ref[rows, kk]

        def column(j, acc):
            row = pl.ds(r0 + j, 1)
            ky = k_ref[row, kk] * jnp.exp(_diag_exponent(g_i, g_ref[row, kk], j, False))
            a_j = jnp.sum(q_i * ky, axis=1, keepdims=True)  # [16, 1]
            s_j = jnp.sum(k_i * ky, axis=1, keepdims=True)
            return acc[0] + jnp.where(col == j, a_j, 0.0), acc[1] + jnp.where(col == j, s_j, 0.0)

        return lax.fori_loop(0, SUB, column, acc)

    a_ii, s_ii = k_slices(kd, k_slice, (zero, zero))
    a_ref[:, rows] = a_ii
    s_ref[:, rows] = jnp.where(lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0) > col, s_ii, 0.0)

    def above(bj, carry):
        cols = pl.ds(pl.multiple_of(bj * SUB, SUB), SUB)
        a_ref[:, cols] = zero
        s_ref[:, cols] = zero
        return carry

    lax.fori_loop(bi + 1, c // SUB, above, 0)


def scores_grads(ds_ref, dst_ref, ds_col: int, x_ref, y_ref, g_ref, kk, strict: bool):
    """dx, dy of the decayed scores for dS = ds_ref[:, ds_col : ds_col + C] (dst_ref holds dS^T
    at the same columns), on the K columns `kk` (a pl.ds) of x, y, g [C, K]: lists of [16, BK]
    per 16-row block; dg = x dx - y dy is left to the caller. Below the diagonal the forward's
    factored products; a diagonal block by two walks (dx over its columns j, dy over its rows
    i), each step a [16, 1] column of dS or dS^T times a row of y or x: no reductions."""
    c = x_ref.shape[0]
    n, bk = c // SUB, kk.size
    dx = [jnp.zeros((SUB, bk), f32) for _ in range(n)]
    dy = [jnp.zeros((SUB, bk), f32) for _ in range(n)]
    for bi in range(n):
        rows = pl.ds(bi * SUB, SUB)
        x_i, g_i = x_ref[rows, kk], g_ref[rows, kk]
        g_r = g_ref[pl.ds(bi * SUB, 1), kk]
        e_ir = jnp.exp(g_i - g_r)
        for bj in range(bi):
            cols = pl.ds(bj * SUB, SUB)
            ds_ij = ds_ref[rows, pl.ds(ds_col + bj * SUB, SUB)]
            e_rj = jnp.exp(g_r - g_ref[cols, kk])
            y_r = y_ref[cols, kk] * e_rj
            dx[bi] += e_ir * jnp.dot(ds_ij, y_r, preferred_element_type=f32)
            dy[bj] += e_rj * lax.dot_general(ds_ij, x_i * e_ir, _TN, preferred_element_type=f32)

        def diag_step(j, acc, bi=bi, rows=rows, g_i=g_i):
            dx_i, dy_i = acc
            at = bi * SUB + j
            g_j = g_ref[pl.ds(at, 1), kk]
            # dx_i += dS[:, j] y_j exp(g_i - g_j) over rows i >= j (> j if strict)
            e = jnp.exp(_diag_exponent(g_i, g_j, j, strict))
            dx_i += ds_ref[rows, pl.ds(ds_col + at, 1)] * y_ref[pl.ds(at, 1), kk] * e
            # dy_i += dS[j, :]^T x_j exp(g_j - g_i) over rows i <= j (< j if strict)
            e_t = jnp.exp(_diag_exponent(g_j, g_i, j, strict, below=False))
            dy_i += dst_ref[rows, pl.ds(ds_col + at, 1)] * x_ref[pl.ds(at, 1), kk] * e_t
            return dx_i, dy_i

        dx[bi], dy[bi] = lax.fori_loop(0, SUB, diag_step, (dx[bi], dy[bi]))
    return dx, dy


def _check(q, k, g):
    c, kd = q.shape[-2:]
    if q.shape != k.shape or q.shape != g.shape:
        raise ValueError(
            f"chunk_scores: q, k, g have shapes {q.shape}, {k.shape}, {g.shape}; expected equal"
        )
    if c % SUB or kd % block_k(kd) or kd < SUB:
        raise ValueError(
            f"chunk_scores: C={c}, K={kd}: expected C a multiple of {SUB} and K a multiple of "
            f"{_BLOCK_K} or a power of two >= {SUB}"
        )
    for name, a in zip("qkg", (q, k, g), strict=True):
        if a.dtype != f32:
            raise ValueError(f"chunk_scores: {name} is {a.dtype}, expected float32")


def chunk_scores(q, k, g, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(S(q, k), S_strict(k, k)) as `reference._chunk_scores` (q, k, g: [..., C, K] fp32 ->
    two [..., C, C]) on one Pallas kernel (forward only: `chunk_vjp` differentiates the core
    around it)."""
    _check(q, k, g)
    lead, (c, kd) = q.shape[:-2], q.shape[-2:]
    flat = lambda a: a.reshape(-1, c, kd)  # noqa: E731
    blk = pl.BlockSpec((None, c, kd), lambda u, b: (u, 0, 0))
    out = pl.BlockSpec((None, SUB, c), lambda u, b: (u, b, 0))
    a, s = pl.pallas_call(
        _scores_kernel,
        out_shape=(jax.ShapeDtypeStruct((flat(q).shape[0], c, c), f32),) * 2,
        grid=(flat(q).shape[0], c // SUB),
        in_specs=[blk, blk, blk],
        out_specs=(out, out),
        compiler_params=plt.CompilerParams(num_warps=_WARPS, num_stages=1),
        name="kda_chunk_scores",
        interpret=common.resolve_interpret(interpret),
    )(flat(q), flat(k), flat(g))
    return a.reshape(*lead, c, c), s.reshape(*lead, c, c)
