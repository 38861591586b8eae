"""The chunked prefill's diagonal blocks (SPEC §5): the first of `chunk_prepare`'s kernels.

One program of one warp per (sequence, sub-block of `sub` rows, head) walks the sub-block's
rows and writes
- the diagonal [sub, sub] block of the q-k scores A (unscaled) and of T = (I + L)^-1, exact at
  any decay strength: the decay between rows is a running product of the rows' exp(g_t), each
  in [0, 1], so no exponent is formed and nothing can overflow;
- the block-local cumulative gate gb (G of a row is gb plus the earlier blocks' last rows of
  gb: `g_from_block_sums`), so the other two kernels form no gate;
- the rows' 1 / ||q|| and 1 / ||k|| (formed for the walk anyway), when q and k arrive raw.
A kernel of its own because the walk is a chain of small steps: many one-warp programs with few
registers each hide its latency by occupancy, which a phase of the per-chunk kernel could not.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gate import beta_math, gate_math

__all__ = ["DiagBlocks", "chunk_diag", "g_from_block_sums"]

f32 = jnp.float32
_LANES = 16  # K's minor part: K is walked as [K/16, 16] tiles


class DiagBlocks(NamedTuple):
    """What `chunk_diag` hands to the other two kernels; rows are the N*C padded tokens."""

    a: jax.Array  # [B, H, N*C, sub] fp32  diagonal blocks of the unscaled q-k scores
    t: jax.Array  # [B, H, N*C, sub] fp32  diagonal blocks of T = (I + L)^-1
    gb: jax.Array  # [B, N*C, H, K] fp32   block-local cumulative gate
    rn: jax.Array  # [B, H, N*C, 2] fp32   1/||q||, 1/||k|| per row (1 when q, k come normalised)


def g_from_block_sums(gb_ref, rows, row_ids, cols, *, sub: int):
    """G of the chunk's rows `rows` (ids row_ids, [n, 1]) over a column slice: the block-local
    sums gb_ref [C, K] plus the earlier blocks' totals (their last rows)."""
    big_g = gb_ref[rows, cols]
    for blk in range(1, gb_ref.shape[0] // sub):
        total = gb_ref[pl.ds(blk * sub - 1, 1), cols]  # block blk - 1's last row
        big_g = big_g + jnp.where(row_ids >= blk * sub, total, 0.0)
    return big_g


def _chunk_diag_kernel(
    len_ref,  # [Bp] int32
    q_ref,  # [sub, K/16, 16]
    k_ref,  # [sub, K/16, 16]
    f_ref,  # [sub, K/16, 16] raw gate input
    b_ref,  # [sub] beta logits
    ea_ref,  # [K/16, 16] exp(A_log[h])
    dt_ref,  # [K/16, 16] dt_bias
    a_ref,  # [sub, sub] fp32 out: scores
    t_ref,  # [sub, sub] fp32 out: the block's T
    gb_ref,  # [sub, K/16, 16] fp32 out: block-local cumulative gate
    rn_ref,  # [sub, 2] fp32 out: 1/||q||, 1/||k||
    *,
    lower_bound,
    l2_eps,
):
    """One (sequence, sub-block, head): a[i, j] = sum_d q_id k_jd exp(G_id - G_jd) and l[i, j]
    (the same with k_i) for j <= i; 0 above the diagonal.

    A walk down the rows with exp(G_i - G_j) = prod_{j < t <= i} exp(g_t): a product only
    underflows where the true value does (the exponential of a difference of cumulative sums
    would also lose the difference's low bits when the sums are large). Each step loads row i
    as [K/16, 16] tiles (one row ahead of its use), in two halves of sub/2 rows:
    - each half keeps its key rows as a [K/16, sub/2, 16] tile (8 of a row's K values in each
      thread: the sums over K are in-thread chains and 4 shuffle steps); step i multiplies the
      tile by exp(g_i), sets column i to k_i and reduces it against q_i and k_i;
    - the second half meets the first half's keys, decayed to its last row m = sub/2 - 1, through
      the running product exp(G_i - G_m): one [K] multiply per row, no tile update.
    Each step stores row i of the scores (two sub/2-column parts; columns not yet set are 0)
    and forms row i of T, L_ij = beta_i l_ij for j < i, by forward substitution:
    t_i = e_i - sum_{j<i} L_ij t_j (T's rows kept in two [sub/2, sub] tiles; fewer instructions
    than a product form (I - L)(I + L^2)(I + L^4)...). It also stores gb row by row (a [K] add)
    and the rows' inverse norms.
    """
    sub, kq, lanes = q_ref.shape
    half = sub // 2
    row0 = pl.program_id(1) * sub
    length = len_ref[pl.program_id(0)]
    cid = lax.broadcasted_iota(jnp.int32, (1, half, 1), 1)  # key column of a half's tile
    ea = ea_ref[...].astype(f32)
    dt = dt_ref[...].astype(f32)

    def fetch(i):
        """Row i of q, k and f as loaded (0 at pads and past the block), [K/16, 16], and
        its beta logit, [1]."""
        ok, at = (i < sub) & (row0 + i < length), jnp.minimum(i, sub - 1)
        rows = tuple(plt.load(r.at[at], mask=ok, other=0.0) for r in (q_ref, k_ref, f_ref))
        idx = row0 + i + jnp.zeros((1,), jnp.int32)
        ok1 = (idx < length) & (idx < row0 + sub)
        return (*rows, plt.load(b_ref.at[pl.ds(at, 1)], mask=ok1, other=0.0))

    def rows_sum(x):
        """[K/16, sub, 16] -> [sub]: the in-thread axis first, then the lanes."""
        return jnp.sum(jnp.sum(x, axis=0), axis=1)

    def finish(i, raw, gsum, norms):
        """Row i normalised, and its decay exp(g_i) (1 at pads); the cumulative gate to row i
        stored, row i's inverse norms set in `norms`."""
        q, k, f, b = (x.astype(f32) for x in raw)
        beta = jnp.where(row0 + i < length, beta_math(b), 0.0)  # [1]
        if l2_eps is not None:
            rq = lax.rsqrt(jnp.sum(jnp.sum(q * q, axis=1)) + l2_eps)
            rk = lax.rsqrt(jnp.sum(jnp.sum(k * k, axis=1)) + l2_eps)
            q, k = q * rq, k * rk
            norms = jnp.where(nrm_row == i, jnp.where(nrm_col == 0, rq, rk), norms)
        g = jnp.where(row0 + i < length, gate_math(f + dt, ea, lower_bound), 0.0)
        gsum = gsum + g
        gb_ref[i] = gsum
        return q, k, jnp.exp(g), beta, gsum, norms

    def own_keys(r, q, k, decay, keys):
        """The half's key tile decayed by row i's gate and its column r set to k_i; row i's
        scores against the half's keys."""
        keys = jnp.where(cid == r, k[:, None, :], keys * decay[:, None, :])
        return keys, rows_sum(keys * q[:, None, :]), rows_sum(keys * k[:, None, :])

    def t_row(i, beta, parts):
        """Row i of T = (I + L)^-1 by forward substitution, t_i = e_i - sum_{j<i} L_ij t_j,
        from the row's k-k scores against each half's keys (already 0 at j > i) and the T rows
        of each half so far (0 at rows >= i)."""
        t = jnp.where(t_col == i, 1.0, 0.0)
        for r, (lk, t_half) in enumerate(parts):
            l_part = beta * jnp.where(half * r + t_key < i, lk, 0.0)
            t = t - jnp.sum(l_part[:, None] * t_half, axis=0)
        return t

    def first(i, carry):
        keys, t0, gsum, norms, raw = carry
        q, k, decay, beta, gsum, norms = finish(i, raw, gsum, norms)
        raw = fetch(i + 1)  # the next row's loads in flight during this row's work
        keys, a, lk = own_keys(i, q, k, decay, keys)
        a_ref[i, pl.ds(0, half)] = a
        a_ref[i, pl.ds(half, half)] = zero
        t0 = jnp.where(t_key[:, None] == i, t_row(i, beta, [(lk, t0)])[None, :], t0)
        return keys, t0, gsum, norms, raw

    def second(i, carry):
        keys0, t0, keys, t1, prod, gsum, norms, raw = carry
        q, k, decay, beta, gsum, norms = finish(i, raw, gsum, norms)
        raw = fetch(i + 1)
        keys, a, lk = own_keys(i - half, q, k, decay, keys)
        prod = prod * decay  # exp(G_i - G_m), m = sub/2 - 1
        a_ref[i, pl.ds(0, half)] = rows_sum(keys0 * (q * prod)[:, None, :])
        a_ref[i, pl.ds(half, half)] = a
        lk0 = rows_sum(keys0 * (k * prod)[:, None, :])
        t = t_row(i, beta, [(lk0, t0), (lk, t1)])
        t1 = jnp.where(t_key[:, None] == i - half, t[None, :], t1)
        return keys0, t0, keys, t1, prod, gsum, norms, raw

    zero = jnp.zeros((half,), f32)
    tile = jnp.zeros((kq, half, lanes), f32)
    row_zero = jnp.zeros((kq, lanes), f32)
    nrm_row = lax.broadcasted_iota(jnp.int32, (sub, 2), 0)
    nrm_col = lax.broadcasted_iota(jnp.int32, (sub, 2), 1)
    norms = jnp.ones((sub, 2), f32)
    t_key = lax.broadcasted_iota(jnp.int32, (half,), 0)  # a half's row (key) of T
    t_col = lax.broadcasted_iota(jnp.int32, (sub,), 0)
    t_zero = jnp.zeros((half, sub), f32)
    # keys0: k_j exp(G_m - G_j)
    keys0, t0, gsum, norms, raw = lax.fori_loop(
        0, half, first, (tile, t_zero, row_zero, norms, fetch(0))
    )
    carry = (keys0, t0, tile, t_zero, jnp.ones((kq, lanes), f32), gsum, norms, raw)
    _, t0, _, t1, _, _, norms, _ = lax.fori_loop(half, sub, second, carry)
    rn_ref[...] = norms
    t_ref[pl.ds(0, half), :] = t0
    t_ref[pl.ds(half, half), :] = t1


def chunk_diag(
    lens, q, k, f, b, a_log, dt_bias, *, chunk, sub, lower_bound, l2_eps, num_warps, interpret
) -> DiagBlocks:
    """The diagonal blocks of every chunk (module docstring).

    Args:
      lens: [Bp] int32, the lengths padded to a power of two; q, k: [B, T, H, K];
      f: [B, T, H*K]; b: [B, T, H]; a_log: [H]; dt_bias: [H*K].
      chunk: C; sub: rows per program (divides C); lower_bound, l2_eps: as in `chunk_prepare`.
      num_warps: Triton warps per program; interpret: Pallas interpret mode (resolved).
    """
    bsz, t, h, kd = q.shape
    tp = -(-t // chunk) * chunk
    ea = jnp.broadcast_to(jnp.exp(a_log.astype(f32))[:, None], (h, kd))
    dt = dt_bias.astype(f32).reshape(h, kd)
    f4 = f.reshape(bsz, t, h, kd)
    diag_shape = jax.ShapeDtypeStruct((bsz, h, tp, sub), f32)
    # K as [K/16, 16] (free reshapes): the key tiles [K/16, sub/2, 16] then keep 8 of a row's K
    # values in each thread, so its sums over K are 8-term in-thread chains and 4 shuffle steps.
    kq = kd // _LANES
    sub_tok = pl.BlockSpec((None, sub, None, kq, _LANES), lambda s, i, hh: (s, i, hh, 0, 0))
    head3 = pl.BlockSpec((None, kq, _LANES), lambda s, i, hh: (hh, 0, 0))
    split = lambda x: x.reshape(*x.shape[:-1], kq, _LANES)  # noqa: E731
    gb_shape = jax.ShapeDtypeStruct((bsz, tp, h, kq, _LANES), f32)
    rn_shape = jax.ShapeDtypeStruct((bsz, h, tp, 2), f32)
    a, t_diag, gb, rn = pl.pallas_call(
        functools.partial(_chunk_diag_kernel, lower_bound=lower_bound, l2_eps=l2_eps),
        out_shape=(diag_shape, diag_shape, gb_shape, rn_shape),
        grid=(bsz, tp // sub, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, i, hh: (0,)),
            sub_tok,
            sub_tok,
            sub_tok,
            pl.BlockSpec((None, sub, None), lambda s, i, hh: (s, i, hh)),
            head3,
            head3,
        ],
        out_specs=(
            *2 * (pl.BlockSpec((None, None, sub, sub), lambda s, i, hh: (s, hh, i, 0)),),
            sub_tok,
            pl.BlockSpec((None, None, sub, 2), lambda s, i, hh: (s, hh, i, 0)),
        ),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kda_chunk_diag",
        interpret=interpret,
    )(lens, *(split(x) for x in (q, k, f4)), b, split(ea), split(dt))
    return DiagBlocks(a=a, t=t_diag, gb=gb.reshape(bsz, tp, h, kd), rn=rn)
