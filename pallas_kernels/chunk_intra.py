"""The chunked prefill's per-chunk kernel (SPEC §5): the second of `chunk_prepare`'s kernels.

One program per (sequence, chunk, head), in phases separated by barriers (`common.barrier`:
the scratch's stores before other threads of the program load them):
  1. Per column slice of `block_k`: qg = s q exp(G), kg = k exp(G_last - G) and
     gl = exp(G_last), with G built from `chunk_diag`'s block sums wherever it is read
     (`g_from_block_sums`), so the kernel forms no gate and keeps no G.
  2. The scores one sub-block of rows at a time: [sub, width] accumulators summed over the
     column slices (loops, not unrolled), stored as rows of A and, for L, into the scratch.
     Only the key rows a sub-block can see are formed: `width` is the next power of two at or
     above its first row. The diagonal blocks are `chunk_diag`'s.
  3. T = (I + L)^-1 by sub-blocks, T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ (full fp32 dots, no
     TF32), stored back into the scratch; T_II is `chunk_diag`'s.
Registers decide the speed here: per-slice temporaries are [C, block_k] or [sub, block_k], so
registers hold little besides the [sub, C] score rows.

Decay safety (SPEC §5, overflow hazard): rows of sub-block b use the reference r = b*sub (the
block's first row): exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), the mask applied before
`exp`, both factors <= 1 for the columns j < r formed here; every exponent is <= 0.
Only the scores use the default (TF32) precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.chunk_diag import DiagBlocks, g_from_block_sums
from pallas_kernels.gate import beta_math

__all__ = ["chunk_intra", "chunk_spec", "token_spec"]

f32 = jnp.float32
HI = lax.Precision.HIGHEST


def token_spec(chunk: int, d: int) -> pl.BlockSpec:
    """A [B, T, H, d] token input's block of one (sequence, chunk, head) program: [C, d]."""
    return pl.BlockSpec((None, chunk, None, d), lambda s, c, hh: (s, c, hh, 0))


def chunk_spec(chunk: int, d: int) -> pl.BlockSpec:
    """A [B, H, N*C, d] chunk-major array's block of one (sequence, chunk, head) program."""
    return pl.BlockSpec((None, None, chunk, d), lambda s, c, hh: (s, hh, c, 0))


def _dot_nt(x, y):
    """x @ y.T with fp32 accumulation (TF32 products for fp32 operands on a GPU)."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=f32)


def _chunk_intra_kernel(
    len_ref,  # [Bp] int32
    q_ref,  # [C, K]
    k_ref,  # [C, K]
    b_ref,  # [C] beta logits
    diag_a_ref,  # [C, sub] fp32, chunk_diag's diagonal score blocks
    diag_t_ref,  # [C, sub] fp32, chunk_diag's diagonal T blocks
    gb_ref,  # [C, K] fp32, chunk_diag's block-local cumulative gate
    rn_ref,  # [C, 2] fp32, chunk_diag's 1/||q||, 1/||k||
    qg_ref,  # [C, K] out
    kg_ref,  # [C, K] out
    a_ref,  # [C, C] out
    gl_ref,  # [1, K] fp32 out
    l_scr_ref,  # [C, 2C] fp32 out: scratch, L then T and the row scales (`chunk_intra`)
    *,
    scale: float,
    l2_eps: float | None,
    sub: int,
    block_k: int,
    interpret: bool,
):
    """One (sequence, chunk, head): phases 1-3 of the module docstring."""
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
        """1 / ||x|| per row from `chunk_diag` (FLA's use_qk_l2norm_in_kernel), or 1 when
        q, k come normalised."""
        if l2_eps is None:
            return 1.0
        return rn_ref[rows, pl.ds(0 if ref is q_ref else 1, 1)]

    g_rows = functools.partial(g_from_block_sums, gb_ref, sub=sub)  # (rows, row_ids, cols)

    rq, rk = inv_norm(q_ref), inv_norm(k_ref)
    beta = jnp.where(valid[:, 0], beta_math(plt.load(b_ref, mask=valid[:, 0], other=0.0)), 0.0)
    beta = beta[:, None]

    # 1. qg, kg and exp(G_last) out, G from `chunk_diag`'s block sums.
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
    common.barrier(interpret)

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
    common.barrier(interpret)

    # 3. T = (I + L)^-1 by sub-blocks (T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ), into the scratch;
    # T_II is `chunk_diag`'s forward substitution.
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
        common.barrier(interpret)

    # 4. w and u are `chunk_wu`'s; L is dead by now (fenced): its columns 0 and 1 hand
    # over the row scales of w and u.
    l_scr_ref[:, pl.ds(0, 1)] = beta * rk
    l_scr_ref[:, pl.ds(1, 1)] = beta


def chunk_intra(
    lens,
    q,
    k,
    b,
    diag: DiagBlocks,
    *,
    chunk,
    scale,
    l2_eps,
    mm_dtype,
    block_k,
    num_warps,
    num_stages,
    interpret,
):
    """qg, kg, A, gl and T of every chunk (module docstring).

    Args:
      lens: [Bp] int32, the lengths padded to a power of two; q, k: [B, T, H, K]; b: [B, T, H].
      diag: `chunk_diag`'s blocks. chunk: C; scale, l2_eps, mm_dtype: as in `chunk_prepare`.
      block_k, num_warps, num_stages: the column slice width and the Triton launch parameters;
      interpret: Pallas interpret mode (resolved).
    Returns:
      qg, kg: [B, H, N*C, K] mm_dtype; a: [B, H, N*C, C] mm_dtype; gl: [B, H, N, K] fp32;
      scratch: [B, H, N*C, 2C] fp32, private to a program until `chunk_wu` reads it: L then T
      (columns C..2C) and, at the end, beta/||k|| and beta in columns 0 and 1.
    """
    bsz, t, h, kd = q.shape
    n = common.cdiv(t, chunk)
    tp = n * chunk
    sub = diag.a.shape[-1]
    kernel = functools.partial(
        _chunk_intra_kernel,
        scale=scale,
        l2_eps=l2_eps,
        sub=sub,
        block_k=block_k,
        interpret=interpret,
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
            jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
            jax.ShapeDtypeStruct((bsz, h, tp, chunk), mm_dtype),
            jax.ShapeDtypeStruct((bsz, h, n, kd), f32),
            jax.ShapeDtypeStruct((bsz, h, tp, 2 * chunk), f32),
        ),
        grid=(bsz, n, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, c, hh: (0,)),
            token_spec(chunk, kd),
            token_spec(chunk, kd),
            pl.BlockSpec((None, chunk, None), lambda s, c, hh: (s, c, hh)),
            chunk_spec(chunk, sub),
            chunk_spec(chunk, sub),
            token_spec(chunk, kd),
            chunk_spec(chunk, 2),
        ],
        out_specs=(
            chunk_spec(chunk, kd),
            chunk_spec(chunk, kd),
            chunk_spec(chunk, chunk),
            pl.BlockSpec((None, None, 1, kd), lambda s, c, hh: (s, hh, c, 0)),
            chunk_spec(chunk, 2 * chunk),
        ),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="kda_chunk_prepare",
        interpret=interpret,
    )(lens, q, k, b, diag.a, diag.t, diag.gb, diag.rn)
