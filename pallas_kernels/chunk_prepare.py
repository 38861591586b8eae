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

Structure (registers decide the speed here: the first version held the [C, K] chunk and whole
[sub, sub] tile sets in registers, spilled, and ran 2-3x slower). Both gates take the same
path (until session 24 a bounded gate far from overflow had the diagonal blocks, G and the
diagonal T blocks formed inside the main kernel, "factorised"; through this path its stage took
655.0 against 710.5 us, H200, B=1, T=8192, C = 32, one job, benchmarks/NOTES.md):
  0. In a kernel of its own (`kda_chunk_diag`, 16-row programs of one warp walking the
     block's rows): the diagonal [sub, sub] blocks of A pairwise (see Decay safety) and of T
     by forward substitution along the walk, the block-local cumulative gate gb (a [K] add
     per row of the walk) and the rows' 1/||q||, 1/||k|| (formed for the walk anyway; the
     main kernel then walks K for no norms: the stage 770.9 against 775.9 us in one job,
     H200, B=1, T=8192); in the main kernel a pairwise loop cost 1.85 of 3.25 ms (H200, B=1,
     T=8192), in this kernel 228 us (278 at 2 warps, 388 for the previous form, an exp2 per
     pair; benchmarks/NOTES.md, sessions 15-16), 240.5 with the stores of gb and the norms.
  1. Per column slice of `block_k`: qg, kg and exp(G_last), with G = gb + the earlier
     blocks' last rows of gb wherever a phase reads it (here, in phase 2 and in the w/u
     kernel), so the main kernel forms no gate and writes no G scratch (the slice loop 815 ->
     312 instructions; H200, 2026-12-02, B=1, T=8192, C = 32, one job: the stage 807.9
     against 868.2 us, the prepare kernel 323.3 against 407.8 in the job before; a variant
     that kept the G scratch took 980.8).
  2. Scores one sub-block of rows at a time: [sub, width] accumulators summed over the column
     slices (loops, not unrolled), stored as rows of A and, for L, into the scratch; the
     diagonal blocks come from phase 0. Only the key rows a sub-block can see are formed:
     `width` is the next power of two at or above its first row (H200, 2026-12-01, B=1,
     T=8192: the kernel 737 against 752 us bounded, 645 against 746 unbounded, in one job).
  3. T = (I + L)^-1 from the scratch's [sub, sub] blocks, stored back into the scratch; the
     diagonal T blocks come from phase 0, by forward substitution along its row walk (the
     stage 704.1 against 755.6 us in one job, H200, B=1, T=8192).
  4. In a second kernel (`kda_chunk_wu`, with its own occupancy: at the defaults ptxas gives it
     119 registers against the first one's 168; H200, 2026-12-01, bounded gate at B=1,
     T=8192: the whole core went from 1771 to 1564 us across the split, in two jobs; a
     one-kernel rewrite measured slower in session 5, benchmarks/NOTES.md), w and u as products
     T @ (beta k exp(G)) and T @ (beta v), slice by slice, from T, G and the row scales left
     in the first kernel's scratch.
Between the phases a barrier (`plt.debug_barrier`, __syncthreads) orders the scratch's stores
before other threads of the same program load them; interpret mode runs in order without one.

Decay safety (SPEC §5, overflow hazard): every exponent evaluated is <= 0. Rows of sub-block b
use the reference r = b*sub (the block's first row): exp(G_i - G_j) = exp(G_i - G_r)
exp(G_r - G_j), the mask applied before `exp`, both factors <= 1 for columns j < r. The
diagonal block is computed by `kda_chunk_diag`, one query row at a time, with exp(G_i - G_j)
as the running product of the rows' decays exp(g_t) in [0, 1] (within each half of the block;
between the halves through the first half's last row m), exact at any decay strength: no
exponent is formed, so nothing can overflow.
T is built block by block: the diagonal [sub, sub] inverses by forward substitution in
`kda_chunk_diag` (fp32 row updates; as accurate as an fp32 triangular solve, measured against
float64 in tests/test_chunk.py), the off-diagonal blocks by T_IJ = -T_II sum_{J<=M<I} L_IM
T_MJ (full fp32 dots, no TF32).
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
_DIAG_LANES = 16  # K's minor part in the diagonal kernel


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
      block_k: width of the K (and V) column slices the main kernel loops over; a power of two
        >= 16 dividing K and V. Per-slice temporaries are [C, block_k] or [sub, block_k], so
        registers hold little besides the [sub, C] score rows. 64 (ptxas at sm_90a 136
        registers, 3 programs/SM, against 120 and 4 at 32. H200, 2026-12-02, B=1, T=8192,
        C = 32, unbounded gate: the stage 667.1 against 699.5 and 690.3 us at 32 in one job,
        714.5 against 730.7 in another; bounded gate, 2026-12-03: 655.0 against 689.5 at 32).
      num_warps: Triton warps per program (8 and 2 measured slower than 4).
      num_stages: Triton software-pipelining depth of the slice loops' loads (1; measured
        while the bounded gate still formed its gate in this kernel: ptxas at sm_90a with
        phase 1 forming the gate once: 125 registers bounded and 124 unbounded at
        1 (120 unbounded since T's diagonal blocks come from the diagonal kernel), 4
        programs/SM; 142 and 127 at 2, with 17 and 11 KB of shared memory for the
        pipelined loads. H200, 2026-12-02, B=1, T=8192, C = 32, one job: the stage 688.8
        against 702.0 us bounded, 870.5 against 879.2 unbounded; 2 had been the faster depth
        before that change).
      diag_warps: Triton warps per program of the diagonal-block kernel (1;
        ptxas at sm_90a: 159 registers at 1 warp (12 programs/SM), 96 at 2, 72 at 4. H200,
        2026-12-02, B=1, T=8192, C = 32, one job: the stage 901.5 us at 1 warp, 959.0 at 2,
        1067.0 at 4, against 1074.6 for the previous kernel, a row walk with an exp2 per pair;
        in the next job the kernel alone 228.4 us at 1 warp against 278.0 at 2 the job before,
        its compiled tests passing on the GPU; 168 registers at 1 warp since the kernel also
        stores gb and the norms and forms T's diagonal blocks).
      wu_block_k, wu_warps, wu_stages: block_k, num_warps and num_stages of the w/u kernel.
    The w/u defaults are the fastest of one H200 job (2026-12-01, B=1, T=8192, H=32, the
    stage alone, all else at the old defaults 16 x 4 x 1, diag_warps 4, wu 16 x 4 x 1; the
    kernels of then, C = 64): num_stages 2 1147 against 1225 us (bounded gate; 1 since
    session 16, above), wu_block_k 64 1158 (32: 1167), diag_warps
    2 1828 against 1981 us (unbounded gate); num_warps 2 was slower (1370). Session 6's job at
    block_k 16 (1082.8 us): num_stages 3 1062.6, wu_stages 2 1080.4, both 1051.4, wu_warps 8
    1095.4, wu_block_k 128 1158.1 (kept as they are: block_k 32 was the one clear gain).
    """

    sub: int = 16
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 1
    diag_warps: int = 1
    wu_block_k: int = 64
    wu_warps: int = 4
    wu_stages: int = 1

    @staticmethod
    def default_for(k: int, v: int) -> PrepareBlockSizes:
        """The defaults, with both kernels' slices no wider than K and V (powers of two >= 16)."""
        d = PrepareBlockSizes
        return d(
            block_k=min(d.block_k, k, v),
            wu_block_k=min(d.wu_block_k, k, v),
        )


def _rows_and_cols(n: int):
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return rows, cols


def _dot_nt(x, y):
    """x @ y.T with fp32 accumulation (TF32 products for fp32 operands on a GPU)."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=f32)


def _g_from_block_sums(gb_ref, rows, row_ids, cols, *, sub: int):
    """G of the chunk's rows `rows` (ids row_ids, [n, 1]) over a column slice: the diagonal
    kernel's block-local sums gb_ref [C, K] plus the earlier blocks' totals (their last rows)."""
    big_g = gb_ref[rows, cols]
    for blk in range(1, gb_ref.shape[0] // sub):
        total = gb_ref[pl.ds(blk * sub - 1, 1), cols]  # block blk - 1's last row
        big_g = big_g + jnp.where(row_ids >= blk * sub, total, 0.0)
    return big_g


def _apply_t(t_full, out_ref, part, block_k: int):
    """out = T @ part, slice by slice of `block_k` columns: part(cols) is [C, block_k] fp32."""

    def body(s, carry):
        cols = pl.ds(s * block_k, block_k)
        prod = jnp.dot(t_full, part(cols), preferred_element_type=f32)
        out_ref[:, cols] = prod.astype(out_ref.dtype)
        return carry

    lax.fori_loop(0, out_ref.shape[1] // block_k, body, 0)


def _diag_pairwise_kernel(
    len_ref,
    q_ref,
    k_ref,
    f_ref,
    b_ref,
    ea_ref,
    dt_ref,
    a_ref,
    t_ref,
    gb_ref,
    rn_ref,
    *,
    lower_bound,
    l2_eps,
):
    """One (sequence, sub-block, head): the diagonal block's scores
    a[i, j] = sum_d q_id k_jd exp(G_id - G_jd) and l[i, j] (the same with k_i) for j <= i, exact
    at any decay strength; 0 above the diagonal.

    A walk down the block's rows with the decay as a running product: exp(G_i - G_j) =
    prod_{j < t <= i} exp(g_t), each factor in [0, 1], so nothing overflows and a product only
    underflows where the true value does (the exp2 of a difference of cumulative sums, the
    previous form, also lost the difference's low bits when the sums were large). Each step
    loads row i as [K/16, 16] tiles (one row ahead of its use), in two halves of sub/2 rows:
    - each half keeps its key rows as a [K/16, sub/2, 16] tile (8 of a row's K values in each
      thread: the sums over K are in-thread chains and 4 shuffle steps); step i multiplies the
      tile by exp(g_i), sets column i to k_i and reduces it against q_i and k_i;
    - the second half meets the first half's keys, decayed to its last row m = sub/2 - 1, through
      the running product exp(G_i - G_m): one [K] multiply per row, no tile update.
    Each step stores row i of the scores (two sub/2-column parts; columns not yet set are 0)
    and forms row i of the block's T = (I + L)^-1, L_ij = beta_i l_ij for j < i, by forward
    substitution: t_i = e_i - sum_{j<i} L_ij t_j (T's rows kept in two [sub/2, sub] tiles; in
    the prepare kernel a product form (I - L)(I + L^2)(I + L^4)... took 816 of its 2088
    instructions, static SASS for sm_90a at C = 32). It also stores the block-local
    cumulative gate sum_{t <= i} g_t (row by row, a [K] add), from which
    `_chunk_prepare_kernel` builds G without forming the gate a second time, and the rows'
    1 / ||q|| and 1 / ||k||, which that kernel then does not form either.

    A kernel of its own (many small programs, few registers: latency hidden by occupancy) rather
    than a phase of `_chunk_prepare_kernel`, where a pairwise loop measured 1.85 ms at B=1,
    T=8192.
    len_ref: [Bp]; q_ref, k_ref, f_ref: [sub, K/16, 16]; b_ref: [sub], beta logits; ea_ref,
    dt_ref: [K/16, 16]; a_ref: [sub, sub], the scores; t_ref: [sub, sub], the block's T;
    gb_ref: [sub, K/16, 16] fp32, the block-local cumulative gate; rn_ref: [sub, 2] fp32,
    1 / ||q|| and 1 / ||k|| per row (1 when q, k come normalised).
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


def _chunk_prepare_kernel(
    len_ref,
    q_ref,
    k_ref,
    b_ref,
    diag_a_ref,
    diag_t_ref,
    gb_ref,
    rn_ref,
    qg_ref,
    kg_ref,
    a_ref,
    gl_ref,
    l_scr_ref,
    *,
    scale: float,
    l2_eps: float | None,
    sub: int,
    block_k: int,
):
    """One (sequence, chunk, head).

    len_ref: [Bp] int32; q_ref, k_ref: [C, K]; b_ref: [C]; diag_a_ref, diag_t_ref: [C, sub]
    fp32, the diagonal blocks' pairwise scores and T blocks from `_diag_pairwise_kernel`;
    gb_ref: [C, K] fp32, that kernel's block-local cumulative gate (G comes from it); rn_ref:
    [C, 2] fp32, its rows' 1 / ||q|| and 1 / ||k||.
    Outputs: qg_ref, kg_ref: [C, K]; a_ref: [C, C]; gl_ref: [1, K]. l_scr_ref [C, 2C] fp32 is
    the kernel's scratch, private to this program until `_chunk_wu_kernel` reads it: L then T
    (columns C..2C) and, at the end, beta/||k|| and beta in columns 0 and 1.
    """
    c, kd = q_ref.shape
    nb, bk = c // sub, block_k
    seq, chunk_idx = pl.program_id(0), pl.program_id(1)
    length = len_ref[seq]
    row = lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    valid = chunk_idx * c + row < length  # [C, 1]

    def over_slices(n_cols, body, carry):
        """carry = body(cols, carry) for each column slice, as a loop (not unrolled: an unrolled
        walk hoists every slice's loads and runs out of registers)."""
        return lax.fori_loop(0, n_cols // bk, lambda s, x: body(pl.ds(s * bk, bk), x), carry)

    all_rows = pl.ds(0, c)

    def load(ref, cols, rows=all_rows, ok=valid):
        """[rows, bk] fp32, 0 at pads and past T (whatever the pads hold)."""
        return plt.load(ref.at[rows, cols], mask=ok, other=0.0).astype(f32)

    def inv_norm(ref, rows=all_rows):
        """1 / ||x|| per row from the diagonal kernel (FLA's use_qk_l2norm_in_kernel), or 1 when
        q, k come normalised."""
        if l2_eps is None:
            return 1.0
        return rn_ref[rows, pl.ds(0 if ref is q_ref else 1, 1)]

    g_rows = functools.partial(_g_from_block_sums, gb_ref, sub=sub)  # (rows, row_ids, cols)

    rq, rk = inv_norm(q_ref), inv_norm(k_ref)
    beta = jnp.where(valid[:, 0], beta_math(plt.load(b_ref, mask=valid[:, 0], other=0.0)), 0.0)
    beta = beta[:, None]

    # 1. qg, kg and exp(G_last) out, G from the diagonal kernel's block sums.
    def cumulative(cols, carry):
        big_g = g_rows(all_rows, row, cols)
        q, k = load(q_ref, cols) * rq, load(k_ref, cols) * rk
        g_last = g_rows(pl.ds(c - 1, 1), jnp.full((1, 1), c - 1, jnp.int32), cols)
        qg_ref[:, cols] = (scale * q * jnp.exp(big_g)).astype(qg_ref.dtype)
        kg_ref[:, cols] = (k * jnp.exp(g_last - big_g)).astype(kg_ref.dtype)
        gl_ref[:, cols] = jnp.exp(g_last)
        return carry

    over_slices(kd, cumulative, 0)
    if l2_eps is not None:  # 1/||k|| for phase 2's key rows, in T's first column until phase 3
        l_scr_ref[:, pl.ds(c, 1)] = rk * jnp.ones((c, 1), f32)
    common.barrier()

    # 2. Scores, one sub-block of rows at a time ([sub, C] accumulators), summed over the column
    # slices, for the key rows before the block. Rows of block `blk` use the reference
    # r = blk*sub (its first row): exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), the mask
    # applied before `exp`, both factors <= 1 for j < r. The diagonal block is the diagonal
    # kernel's (pairwise, exact at any decay strength).
    cols_c = lax.broadcasted_iota(jnp.int32, (1, c), 1)

    for blk in range(nb):
        r0 = blk * sub  # the block's first row: the reference r, and its first own key column
        rows = pl.ds(r0, sub)
        row_ids = r0 + lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
        ok = chunk_idx * c + row_ids < length
        bq, bkn = inv_norm(q_ref, rows), inv_norm(k_ref, rows)
        # Key rows at or past r0 are masked out: only the first `width` (a power of two) are
        # formed, loaded and multiplied.
        width = common.next_pow2(r0) if r0 else 0
        beta_b = jnp.where(
            ok, beta_math(plt.load(b_ref.at[rows], mask=ok[:, 0], other=0.0))[:, None], 0.0
        )
        diag = cols_c // sub == blk
        # A's columns past `width` are zeros (the diagonal block aside): stored apart, at
        # addresses disjoint from the stores below. `& (row_ids >= 0)` (always true) broadcasts
        # a [1, n] column mask to the stored tile's [sub, n].
        plt.store(
            a_ref.at[rows, :],
            jnp.zeros((sub, c), a_ref.dtype),
            mask=(cols_c >= width) & ~diag & (row_ids >= 0),
        )
        if width:
            keys = pl.ds(0, width)
            key_row = lax.broadcasted_iota(jnp.int32, (width, 1), 0)
            key_ok = chunk_idx * c + key_row < length
            key_rk = 1.0 if l2_eps is None else l_scr_ref[keys, pl.ds(c, 1)]

            def scores(
                cols,
                accs,
                rows=rows,
                row_ids=row_ids,
                ok=ok,
                bq=bq,
                bkn=bkn,
                r0=r0,
                keys=keys,
                key_row=key_row,
                key_ok=key_ok,
                key_rk=key_rk,
            ):
                q_b, k_b = load(q_ref, cols, rows, ok) * bq, load(k_ref, cols, rows, ok) * bkn
                g_r = g_rows(pl.ds(r0, 1), jnp.full((1, 1), r0, jnp.int32), cols)
                to_r = jnp.exp(g_rows(rows, row_ids, cols) - g_r)
                from_r = jnp.where(key_row < r0, g_r - g_rows(keys, key_row, cols), -jnp.inf)
                k_col = load(k_ref, cols, keys, key_ok) * key_rk * jnp.exp(from_r)
                acc_a, acc_l = accs
                return acc_a + _dot_nt(q_b * to_r, k_col), acc_l + _dot_nt(k_b * to_r, k_col)

            zero_r = jnp.zeros((sub, width), f32)
            acc_a, acc_l = over_slices(kd, scores, (zero_r, zero_r))
            cols_w = lax.broadcasted_iota(jnp.int32, (1, width), 1)
            a_rows = jnp.where(cols_w <= row_ids, scale * acc_a, 0.0).astype(a_ref.dtype)
            l_rows = jnp.where(cols_w < row_ids, beta_b * acc_l, 0.0)
            off = cols_w // sub != blk
            plt.store(a_ref.at[rows, keys], a_rows, mask=off & (row_ids >= 0))
            plt.store(l_scr_ref.at[rows, keys], l_rows, mask=off & (row_ids >= 0))
        # The diagonal block beside the rest of the rows (disjoint addresses).
        a_ref[rows, pl.ds(r0, sub)] = (scale * diag_a_ref[rows, :]).astype(a_ref.dtype)
    common.barrier()

    # 3. T = (I + L)^-1 by sub-blocks (T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ), into the scratch;
    # T_II is the diagonal kernel's forward substitution.
    def l_blk(i, j):
        return l_scr_ref[pl.ds(i * sub, sub), pl.ds(j * sub, sub)]

    def t_blk(i, j):
        return l_scr_ref[pl.ds(i * sub, sub), pl.ds(c + j * sub, sub)]

    for i in range(nb):  # row i needs T of rows < i only: stored and fenced by then
        t_ii = diag_t_ref[pl.ds(i * sub, sub), :]
        l_scr_ref[pl.ds(i * sub, sub), pl.ds(c + i * sub, sub)] = t_ii
        for j in range(i - 1, -1, -1):
            acc = sum(
                jnp.dot(l_blk(i, m), t_blk(m, j), precision=HI, preferred_element_type=f32)
                for m in range(j, i)
            )
            t_ij = -jnp.dot(t_ii, acc, precision=HI, preferred_element_type=f32)
            l_scr_ref[pl.ds(i * sub, sub), pl.ds(c + j * sub, sub)] = t_ij
        common.barrier()

    # 4. w and u are `_chunk_wu_kernel`'s; L is dead by now (fenced): its columns 0 and 1 hand
    # over the row scales of w and u.
    l_scr_ref[:, pl.ds(0, 1)] = beta * rk
    l_scr_ref[:, pl.ds(1, 1)] = beta


def _chunk_wu_kernel(len_ref, k_ref, v_ref, t_ref, gb_ref, w_ref, u_ref, *, sub, block_k):
    """Phase 4 of the prepare stage: one (sequence, chunk, head).

    len_ref: [Bp] int32; k_ref: [C, K]; v_ref: [C, V]; t_ref: [C, 2C] fp32, the prepare
    kernel's scratch (T in columns C..2C, beta/||k|| and beta in columns 0 and 1); gb_ref:
    [C, K] fp32, the diagonal kernel's block-local sums G is built from. Outputs:
    w_ref [C, K] = T (beta k exp(G)), u_ref [C, V] = T (beta v).
    """
    c = k_ref.shape[0]
    seq, chunk_idx = pl.program_id(0), pl.program_id(1)
    row = lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    valid = chunk_idx * c + row < len_ref[seq]

    def g_of(cols):
        return _g_from_block_sums(gb_ref, pl.ds(0, c), row, cols, sub=sub)

    def load(ref, cols):  # 0 at pads and past T (whatever the pads hold)
        return plt.load(ref.at[:, cols], mask=valid, other=0.0).astype(f32)

    rows_cc, cols_cc = _rows_and_cols(c)
    # T from the scratch's columns C..2C; blocks above the diagonal are never written (0).
    t_full = plt.load(t_ref.at[:, pl.ds(c, c)], mask=rows_cc // sub >= cols_cc // sub, other=0.0)
    w_scale, u_scale = t_ref[:, pl.ds(0, 1)], t_ref[:, pl.ds(1, 1)]
    _apply_t(t_full, w_ref, lambda cols: w_scale * load(k_ref, cols) * jnp.exp(g_of(cols)), block_k)
    _apply_t(t_full, u_ref, lambda cols: u_scale * load(v_ref, cols), block_k)


def _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, blk):
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
    if chunk % blk.sub:
        raise ValueError(f"chunk_prepare: chunk={chunk} must be a multiple of sub={blk.sub}")
    for name in ("block_k", "wu_block_k"):
        bk = getattr(blk, name)
        if bk < 16 or bk & (bk - 1) or kd % bk or vd % bk:
            raise ValueError(
                f"chunk_prepare: {name}={bk} must be a power of two >= 16 dividing "
                f"K={kd} and V={vd}"
            )


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
    blk = PrepareBlockSizes.default_for(q.shape[-1], v.shape[-1])
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
    _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, blk)
    bsz, t, h, kd = q.shape
    vd = v.shape[-1]
    n = common.cdiv(t, chunk)
    tp = n * chunk
    lens = jnp.zeros((common.next_pow2(bsz),), jnp.int32).at[:bsz].set(lengths.astype(jnp.int32))
    ea = jnp.broadcast_to(jnp.exp(a_log.astype(f32))[:, None], (h, kd))
    dt = dt_bias.astype(f32).reshape(h, kd)

    tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda s, c, hh: (s, c, hh, 0))  # noqa: E731
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
    f4 = f.reshape(bsz, t, h, kd)
    sub = blk.sub
    diag_shape = jax.ShapeDtypeStruct((bsz, h, tp, sub), f32)
    # K as [K/16, 16] (free reshapes): the key tiles [K/16, sub/2, 16] then keep 8 of a row's K
    # values in each thread, so its sums over K are 8-term in-thread chains and 4 shuffle steps.
    kq = kd // _DIAG_LANES
    sub_tok = pl.BlockSpec((None, sub, None, kq, _DIAG_LANES), lambda s, i, hh: (s, i, hh, 0, 0))
    head3 = pl.BlockSpec((None, kq, _DIAG_LANES), lambda s, i, hh: (hh, 0, 0))
    split = lambda x: x.reshape(*x.shape[:-1], kq, _DIAG_LANES)  # noqa: E731
    gb_shape = jax.ShapeDtypeStruct((bsz, tp, h, kq, _DIAG_LANES), f32)
    rn_shape = jax.ShapeDtypeStruct((bsz, h, tp, 2), f32)
    diag_a, diag_t, gb, rn = pl.pallas_call(
        functools.partial(_diag_pairwise_kernel, lower_bound=lower_bound, l2_eps=l2_eps),
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
        compiler_params=plt.CompilerParams(num_warps=blk.diag_warps, num_stages=1),
        name="kda_chunk_diag",
        interpret=common.interpret(),
    )(lens, *(split(x) for x in (q, k, f4)), b, split(ea), split(dt))
    gb = gb.reshape(bsz, tp, h, kd)
    kernel = functools.partial(
        _chunk_prepare_kernel, scale=scale, l2_eps=l2_eps, sub=sub, block_k=blk.block_k
    )
    # The last output is the kernel's scratch: L then T, and the row scales of w and u.
    scr_shape = jax.ShapeDtypeStruct((bsz, h, tp, 2 * chunk), f32)
    kept = [name for name in ChunkIntermediates._fields if name not in ("w", "u")]
    res = pl.pallas_call(
        kernel,
        out_shape=(*(getattr(out_shape, n) for n in kept), scr_shape),
        grid=(bsz, n, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, c, hh: (0,)),
            tok(kd),
            tok(kd),
            pl.BlockSpec((None, chunk, None), lambda s, c, hh: (s, c, hh)),
            inter(sub),
            inter(sub),
            tok(kd),
            inter(2),
        ],
        out_specs=(*(getattr(out_specs, n) for n in kept), inter(2 * chunk)),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        name="kda_chunk_prepare",
        interpret=common.interpret(),
    )(lens, q, k, b, diag_a, diag_t, gb, rn)
    outs = dict(zip(kept, res[:-1], strict=True))
    outs["w"], outs["u"] = pl.pallas_call(
        functools.partial(_chunk_wu_kernel, sub=sub, block_k=blk.wu_block_k),
        out_shape=(out_shape.w, out_shape.u),
        grid=(bsz, n, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, c, hh: (0,)),
            tok(kd),
            tok(vd),
            inter(2 * chunk),
            tok(kd),
        ],
        out_specs=(out_specs.w, out_specs.u),
        compiler_params=plt.CompilerParams(num_warps=blk.wu_warps, num_stages=blk.wu_stages),
        name="kda_chunk_wu",
        interpret=common.interpret(),
    )(lens, k, v, res[-1], gb)
    return ChunkIntermediates(**outs)
