"""Intra-chunk stage of the chunked prefill (SPEC §5, steps 1-3): everything that needs no state.

One program per (sequence, chunk, head) reads the chunk's q, k, v, raw gate input f and beta
logits, and writes what the state pass (`chunk_scan`) needs, so that pass does four matrix
products per chunk and nothing else:

    g       = gate(f), beta = sigmoid(b)         0 at pads (t >= lengths[b]), whatever they hold
    G       = chunk-local inclusive cumsum of g  [C, K] fp32, G <= 0, decreasing
    A[i,j]  = s sum_d q_i k_j exp(G_i - G_j)     j <= i          (q-k scores)
    L[i,j]  = beta_i sum_d k_i k_j exp(G_i - G_j) j < i          (k-k, strictly lower)
    T       = (I + L)^-1
    w       = T (beta * k * exp(G)),  u = T (beta * v)
    qg      = s q exp(G),  kg = k exp(G_last - G),  gl = exp(G_last)

Decay safety (SPEC §5, overflow hazard): every exponent evaluated is <= 0. The chunk is cut into
sub-blocks of `sub` rows. With the unbounded gate, a diagonal sub-block is computed pairwise, one
query row at a time for all sub-blocks together (block-local sums Gl_r accumulated token by
token, then exp(Gl_r - Gl_j) for all j <= r with the mask applied before `exp`, reductions along
K only). With a bounded gate whose sub-block span stays far from overflow
((sub - 1) |lb| <= 80 nats, e.g. lb = -5) the diagonal factorises around its middle row instead
(one product). An off-diagonal tile (row block I > column block J) factorises around r, the last
token of block I-1: exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both exponents <= 0.
T is built block by block: the diagonal [sub, sub] inverses as (I - L)(I + L^2)(I + L^4)(I + L^8)
plus one Newton step (as accurate as an fp32 triangular solve, measured against float64), the
off-diagonal blocks by T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ (full fp32 dots, no TF32).
Only the products that feed the state pass (scores, w, u) use the default (TF32) precision.

Layouts (written chunk-major per (sequence, head), the order `chunk_scan` walks them):
  qg, kg, w: [B, H, N*C, K] mm_dtype;  u: [B, H, N*C, V] fp32 (the state pass subtracts from it);
  a: [B, H, N*C, C] mm_dtype (zeros above the diagonal);  gl: [B, H, N, K] fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.gate import beta_math, gate_math

__all__ = ["ChunkIntermediates", "PrepareBlockSizes", "chunk_prepare"]

f32 = jnp.float32
HI = lax.Precision.HIGHEST
# Largest masked-out exponent the factorised diagonal may form (fp32 exp overflows past 88).
_FACTORISED_MAX_NATS = 80.0


class ChunkIntermediates(NamedTuple):
    """What `chunk_prepare` hands to `chunk_scan` (layouts in the module docstring)."""

    qg: jax.Array  # [B, H, N*C, K]  s q exp(G)
    kg: jax.Array  # [B, H, N*C, K]  k exp(G_last - G)
    w: jax.Array  # [B, H, N*C, K]  T (beta k exp(G))
    u: jax.Array  # [B, H, N*C, V]  T (beta v), fp32
    a: jax.Array  # [B, H, N*C, C]  masked q-k scores, zeros above the diagonal
    gl: jax.Array  # [B, H, N, K]    exp(G_last), fp32


@dataclasses.dataclass(frozen=True)
class PrepareBlockSizes:
    """Tiling of `chunk_prepare`.

    Attributes:
      sub: rows of a sub-block (16: the smallest Triton dot side); divides the chunk.
      num_warps: Triton warps per program.
    """

    sub: int = 16
    num_warps: int = 4

    @staticmethod
    def default_for(chunk: int, head_dim: int) -> PrepareBlockSizes:
        """16-row sub-blocks; 8 warps once the [chunk, K] tiles outgrow 4 warps' registers."""
        return PrepareBlockSizes(sub=16, num_warps=8 if chunk * head_dim >= 64 * 128 else 4)


def _rows_and_cols(n: int):
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return rows, cols


def _diag_pairwise(k_tiles, load_row, *, sub: int):
    """Local cumulative decay and pairwise scores of every diagonal sub-block, row by row.

    Row r of each block (the blocks advance together, for independent work per step): the local
    running sum Gl_r = Gl_{r-1} + g_r (G relative to the block's start), then A[r, j] and L[r, j]
    for every j <= r at once from exp(Gl_r - Gl_j) over the rows built so far, the mask applied
    before `exp` (exponents <= 0 at any decay). Only reductions along K are needed (within a
    warp); the scores are built transposed.

    k_tiles: nb x [sub, K]; load_row(i, r) -> (g, q, k) of row r of block i, each [1, K], 0 at
    pads. Returns per block (Gl [sub, K], Gl of the last row [1, K] (the same bits),
    qk [sub, sub] with j <= i, kk [sub, sub] with j < i).
    """
    rows, cols = _rows_and_cols(sub)
    row_ids = lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
    col_ids = lax.broadcasted_iota(jnp.int32, (1, sub), 1)

    def row(r, acc):
        out = []
        for i, (g_run, gt, qk_t, kk_t) in enumerate(acc):
            g_r, q_r, k_r = load_row(i, r)
            g_run = g_run + g_r  # Gl at row r; its tile row below holds the same bits
            gt = jnp.where(row_ids == r, g_run, gt)
            kd = k_tiles[i] * jnp.exp(jnp.where(row_ids <= r, g_run - gt, -jnp.inf))
            qk_t = jnp.where(col_ids == r, jnp.sum(kd * q_r, axis=1, keepdims=True), qk_t)
            kk_t = jnp.where(col_ids == r, jnp.sum(kd * k_r, axis=1, keepdims=True), kk_t)
            out.append((g_run, gt, qk_t, kk_t))
        return tuple(out)

    kd_ = k_tiles[0].shape[1]
    zero = jnp.zeros((sub, sub), f32)
    init = tuple(
        (jnp.zeros((1, kd_), f32), jnp.zeros((sub, kd_), f32), zero, zero) for _ in k_tiles
    )
    res = lax.fori_loop(0, sub, row, init)
    return [(gt, g_run, qk.T, jnp.where(rows > cols, kk.T, 0.0)) for g_run, gt, qk, kk in res]


def _diag_scores_factorised(q, k, G, *, sub: int):
    """The same scores by one product each, factorised around the middle row m of the block.

    Only for a bounded gate with (sub - 1) * |lb| <= _FACTORISED_MAX_NATS: a factor's exponent is
    then at most sub/2 * |lb| and a masked-out product at most (sub - 1) * |lb|, far from fp32
    overflow (88 nats); the kept entries are exactly exp(G_i - G_j) <= 1.
    """
    rows, cols = _rows_and_cols(sub)
    row_ids = lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
    g_m = jnp.sum(jnp.where(row_ids == sub // 2, G, 0.0), axis=0, keepdims=True)  # [1, K]
    to_m, from_m = jnp.exp(G - g_m), jnp.exp(g_m - G)
    kd = k * from_m
    dims = (((1,), (1,)), ((), ()))
    qk = lax.dot_general(q * to_m, kd, dims, preferred_element_type=f32)
    kk = lax.dot_general(k * to_m, kd, dims, preferred_element_type=f32)
    return jnp.where(rows >= cols, qk, 0.0), jnp.where(rows > cols, kk, 0.0)


def _needs_pairwise(lower_bound: float | None, sub: int) -> bool:
    """Whether diagonal sub-blocks must be computed pairwise (unbounded or strong bounded gate)."""
    return lower_bound is None or (sub - 1) * abs(lower_bound) > _FACTORISED_MAX_NATS


def _unit_lower_inverse(lmat, *, sub: int):
    """(I + L)^-1 of a strictly lower [sub, sub] L: (I - L)(I + L^2)(I + L^4)...(I + L^(sub/2)).

    L^sub = 0, so the product is exact algebra; the dots run in full fp32 (no TF32). Measured
    against a float64 solve in tests/test_chunk.py.
    """
    rows, cols = _rows_and_cols(sub)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(f32)
    dot = functools.partial(jnp.dot, precision=HI, preferred_element_type=f32)
    inv, power, m = eye - lmat, lmat, 2
    while m < sub:
        power = dot(power, power)  # L^m
        inv = dot(inv, eye + power)
        m *= 2
    # One Newton step, X <- X + X (I - (I + L) X), squares the product form's rounding error.
    return inv + dot(inv, eye - dot(eye + lmat, inv))


def _chunk_prepare_kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    f_ref,
    b_ref,
    ea_ref,
    dt_ref,
    qg_ref,
    kg_ref,
    w_ref,
    u_ref,
    a_ref,
    gl_ref,
    *,
    scale: float,
    lower_bound: float | None,
    l2_eps: float | None,
    sub: int,
):
    """One (sequence, chunk, head).

    len_ref: [Bp] int32; q_ref, k_ref, f_ref: [C, K]; v_ref: [C, V]; b_ref: [C]; ea_ref (exp A_log
    broadcast over K), dt_ref: [K]. Outputs: qg_ref, kg_ref, w_ref: [C, K]; u_ref: [C, V];
    a_ref: [C, C]; gl_ref: [1, K].
    """
    c = q_ref.shape[0]
    nb = c // sub
    seq, chunk_idx = pl.program_id(0), pl.program_id(1)
    length = len_ref[seq]
    ea = ea_ref[...].astype(f32)[None, :]
    dt = dt_ref[...].astype(f32)[None, :]
    offs = lax.broadcasted_iota(jnp.int32, (sub,), 0)
    pairwise = _needs_pairwise(lower_bound, sub)
    kd_ = ea.shape[1]

    def block(i):
        """Sub-block i (rows i*sub..): validity, a masked loader (pads and rows past T read 0;
        q and k come back L2-normalised when l2_eps is set) and beta [sub, 1] (0 at pads)."""
        valid = chunk_idx * c + i * sub + offs < length  # [sub]
        rows = pl.ds(i * sub, sub)

        def load(ref, qk: bool = False):
            x = plt.load(ref.at[rows, :], mask=valid[:, None], other=0.0).astype(f32)
            if qk and l2_eps is not None:
                x = x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + l2_eps)
            return x

        beta = jnp.where(valid, beta_math(plt.load(b_ref.at[rows], mask=valid, other=0.0)), 0.0)
        return valid, load, beta[:, None]

    def tile(ref, i):
        return ref.at[pl.ds(i * sub, sub), :]

    def gate_rows(load, valid):
        return jnp.where(valid, gate_math(load(f_ref) + dt, ea, lower_bound), 0.0)

    def load_row(i, r):
        """g, q, k of token i*sub + r for `_diag_pairwise`, each [1, K], 0 at pads."""
        valid = jnp.broadcast_to(chunk_idx * c + i * sub + r < length, (1, kd_))
        rows = pl.ds(i * sub + r, 1)
        load = lambda ref: plt.load(ref.at[rows, :], mask=valid, other=0.0).astype(f32)  # noqa
        q_r, k_r = load(q_ref), load(k_ref)
        if l2_eps is not None:
            q_r = q_r * lax.rsqrt(jnp.sum(q_r * q_r, axis=1, keepdims=True) + l2_eps)
            k_r = k_r * lax.rsqrt(jnp.sum(k_r * k_r, axis=1, keepdims=True) + l2_eps)
        return gate_rows(load, valid), q_r, k_r

    last_row = lax.broadcasted_iota(jnp.int32, (sub, 1), 0) == sub - 1

    def diag_factorised(i):
        """Local cumsum and factorised diagonal scores of block i (bounded gate)."""
        valid, load, _ = block(i)
        g_loc = jnp.cumsum(gate_rows(load, valid[:, None]), axis=0)
        g_tot = jnp.sum(jnp.where(last_row, g_loc, 0.0), axis=0, keepdims=True)  # exact pick
        qk, kk = _diag_scores_factorised(load(q_ref, qk=True), load(k_ref, qk=True), g_loc, sub=sub)
        return g_loc, g_tot, qk, kk

    # 1-2. Gate and chunk-local cumulative log-decay G (g = 0 at pads keeps G flat), then the
    # score tiles A_IJ (j <= i, stored now) and L_IJ (j < i), every exponent <= 0. Diagonal
    # blocks work on block-local sums Gl; G = Gl + (G before the block). The carry into block i+1
    # is computed with the same operation as G's last row, so G_r - G_r is 0 to the bit wherever
    # a factorisation meets its reference token r.
    if pairwise:
        k_tiles = []
        for i in range(nb):
            _, load, _ = block(i)
            k_tiles.append(load(k_ref, qk=True))
        diag = _diag_pairwise(k_tiles, load_row, sub=sub)
    else:
        diag = [diag_factorised(i) for i in range(nb)]
    gs, gls, starts, l_t = [], [], [], {}
    carry = jnp.zeros((1, kd_), f32)
    dims = (((1,), (1,)), ((), ()))
    for i in range(nb):
        _, load, beta = block(i)
        q_i, k_i = load(q_ref, qk=True), load(k_ref, qk=True)
        g_loc, g_tot, qk, kk = diag[i]
        starts.append(carry)  # G at the last token of block i-1 (0 before the chunk)
        g_i = g_loc + carry
        carry = g_tot + carry
        gs.append(g_i)
        gls.append(g_loc)
        a_t = {i: scale * qk}
        l_t[i, i] = beta * kk
        if i:
            to_r = jnp.exp(g_loc)  # rows of block i back to r = last token of block i-1
            q_r, k_r = q_i * to_r, k_i * to_r
            for j in range(i):
                _, load_j, _ = block(j)
                from_r = jnp.exp((starts[i] - starts[j]) - gls[j])  # r back to columns of j
                k_j = load_j(k_ref, qk=True) * from_r
                a_t[j] = scale * lax.dot_general(q_r, k_j, dims, preferred_element_type=f32)
                l_t[i, j] = beta * lax.dot_general(k_r, k_j, dims, preferred_element_type=f32)
        for j in range(nb):
            a_ij = a_t[j] if j <= i else jnp.zeros((sub, sub), f32)
            a_ref[pl.ds(i * sub, sub), pl.ds(j * sub, sub)] = a_ij.astype(a_ref.dtype)
    g_last = carry
    gl_ref[...] = jnp.exp(g_last)

    # 3. T = (I + L)^-1 by sub-blocks: T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ.
    t_t = {(i, i): _unit_lower_inverse(l_t[i, i], sub=sub) for i in range(nb)}
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):
            acc = sum(
                jnp.dot(l_t[i, m], t_t[m, j], precision=HI, preferred_element_type=f32)
                for m in range(j, i)
            )
            t_t[i, j] = -jnp.dot(t_t[i, i], acc, precision=HI, preferred_element_type=f32)

    # 4. w = T (beta k exp(G)), u = T (beta v), and the scan's pre-decayed q and k.
    for i in range(nb):
        _, load, _ = block(i)
        q_i, k_i = load(q_ref, qk=True), load(k_ref, qk=True)
        tile(qg_ref, i)[...] = (scale * q_i * jnp.exp(gs[i])).astype(qg_ref.dtype)
        tile(kg_ref, i)[...] = (k_i * jnp.exp(g_last - gs[i])).astype(kg_ref.dtype)
        w_acc = jnp.zeros(k_i.shape, f32)
        u_acc = jnp.zeros((sub, v_ref.shape[1]), f32)
        for j in range(i + 1):
            _, load_j, beta_j = block(j)
            kb = beta_j * load_j(k_ref, qk=True) * jnp.exp(gs[j])
            vb = beta_j * load_j(v_ref)
            w_acc += jnp.dot(t_t[i, j], kb, preferred_element_type=f32)
            u_acc += jnp.dot(t_t[i, j], vb, preferred_element_type=f32)
        tile(w_ref, i)[...] = w_acc.astype(w_ref.dtype)
        tile(u_ref, i)[...] = u_acc.astype(u_ref.dtype)


def _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, sub):
    bsz, t, h, kd = q.shape
    vd = v.shape[-1]
    want = {
        "k": (k.shape, (bsz, t, h, kd)),
        "v": (v.shape, (bsz, t, h, vd)),
        "f": (f.shape, (bsz, t, h * kd)),
        "b": (b.shape, (bsz, t, h)),
        "lengths": (lengths.shape, (bsz,)),
        "a_log": (a_log.shape, (h,)),
        "dt_bias": (dt_bias.shape, (h * kd,)),
    }
    for name, (got, exp) in want.items():
        if tuple(got) != exp:
            raise ValueError(f"chunk_prepare: {name} has shape {tuple(got)}, expected {exp}")
    for name, n in (("K", kd), ("V", vd), ("chunk", chunk)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"chunk_prepare: {name}={n} must be a power of two >= 16")
    if chunk % sub:
        raise ValueError(f"chunk_prepare: chunk={chunk} must be a multiple of sub={sub}")


@functools.partial(jax.jit, static_argnames=("scale", "chunk", "lower_bound", "mm_dtype", "l2_eps"))
def chunk_prepare(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    f: jax.Array,
    b: jax.Array,
    lengths: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    *,
    scale: float,
    chunk: int,
    lower_bound: float | None,
    mm_dtype=jnp.bfloat16,
    l2_eps: float | None = None,
) -> ChunkIntermediates:
    """Gate, cumsum, scores, (I+L)^-1, w and u for every chunk (module docstring).

    Args:
      q, k: [B, T, H, K] L2-normalised (q unscaled); v: [B, T, H, V]; any float dtype.
      f: [B, T, H*K] raw forget-gate input; b: [B, T, H] beta logits.
      lengths: [B] int32 in [0, T]; positions t >= lengths[b] are pads (may hold NaN).
      a_log: [H] fp32; dt_bias: [H*K] fp32.
      scale: s = K^-0.5; chunk: C (power of two >= 16); T need not be a multiple of it.
      lower_bound: lb of the bounded gate, None for the unbounded gate.
      mm_dtype: storage dtype of qg, kg, w, a (bf16 for speed, fp32 for accuracy); u is fp32.
      l2_eps: when set, q and k arrive raw and are L2-normalised here, 1/sqrt(sum + l2_eps)
        per head (FLA's use_qk_l2norm_in_kernel); None: they are normalised already.
    Returns:
      ChunkIntermediates with N = ceil(T / C) chunks per sequence.
    """
    blk = PrepareBlockSizes.default_for(chunk, q.shape[-1])
    return _chunk_prepare(
        q,
        k,
        v,
        f,
        b,
        lengths,
        a_log,
        dt_bias,
        scale=scale,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=mm_dtype,
        l2_eps=l2_eps,
        blk=blk,
    )


@functools.partial(
    jax.jit, static_argnames=("scale", "chunk", "lower_bound", "mm_dtype", "l2_eps", "blk")
)
def _chunk_prepare(
    q, k, v, f, b, lengths, a_log, dt_bias, *, scale, chunk, lower_bound, mm_dtype, l2_eps, blk
) -> ChunkIntermediates:
    """`chunk_prepare` with explicit block sizes (benchmarks sweep them)."""
    _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, blk.sub)
    bsz, t, h, kd = q.shape
    vd = v.shape[-1]
    n = common.cdiv(t, chunk)
    tp = n * chunk
    lens = jnp.zeros((common.next_pow2(bsz),), jnp.int32).at[:bsz].set(lengths.astype(jnp.int32))
    ea = jnp.broadcast_to(jnp.exp(a_log.astype(f32))[:, None], (h, kd))
    dt = dt_bias.astype(f32).reshape(h, kd)

    tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda s, c, hh: (s, c, hh, 0))  # noqa: E731
    head = pl.BlockSpec((None, kd), lambda s, c, hh: (hh, 0))
    inter = lambda d: pl.BlockSpec((None, None, chunk, d), lambda s, c, hh: (s, hh, c, 0))  # noqa: E731
    out_shape = ChunkIntermediates(
        qg=jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
        kg=jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
        w=jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
        u=jax.ShapeDtypeStruct((bsz, h, tp, vd), f32),
        a=jax.ShapeDtypeStruct((bsz, h, tp, chunk), mm_dtype),
        gl=jax.ShapeDtypeStruct((bsz, h, n, kd), f32),
    )
    out_specs = ChunkIntermediates(
        qg=inter(kd),
        kg=inter(kd),
        w=inter(kd),
        u=inter(vd),
        a=inter(chunk),
        gl=pl.BlockSpec((None, None, 1, kd), lambda s, c, hh: (s, hh, c, 0)),
    )
    kernel = functools.partial(
        _chunk_prepare_kernel, scale=scale, lower_bound=lower_bound, l2_eps=l2_eps, sub=blk.sub
    )
    res = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(bsz, n, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, c, hh: (0,)),
            tok(kd),
            tok(kd),
            tok(vd),
            tok(kd),
            pl.BlockSpec((None, chunk, None), lambda s, c, hh: (s, c, hh)),
            head,
            head,
        ],
        out_specs=tuple(out_specs),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=1),
        name="kda_chunk_prepare",
        interpret=common.interpret(),
    )(lens, q, k, v, f.reshape(bsz, t, h, kd), b, ea, dt)
    return ChunkIntermediates(*res)
