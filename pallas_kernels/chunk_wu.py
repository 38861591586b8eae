"""The chunked prefill's w and u (SPEC §5): the last of `chunk_prepare`'s kernels.

One program per (sequence, chunk, head) forms w = T (beta k exp(G)) and u = T (beta v), slice
by slice of `block_k` columns, from T and the row scales that `chunk_intra` left in its scratch
and G built from `chunk_diag`'s block sums. A kernel of its own: it needs far fewer registers
than `chunk_intra`, so more of its programs fit on an SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.chunk_diag import g_from_block_sums
from pallas_kernels.chunk_intra import chunk_spec, token_spec

__all__ = ["chunk_wu"]

f32 = jnp.float32


def _rows_and_cols(n: int):
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return rows, cols


def _apply_t(t_full, out_ref, part, block_k: int):
    """out = T @ part, slice by slice of `block_k` columns: part(cols) is [C, block_k] fp32."""

    def body(s, carry):
        cols = pl.ds(s * block_k, block_k)
        prod = jnp.dot(t_full, part(cols), preferred_element_type=f32)
        out_ref[:, cols] = prod.astype(out_ref.dtype)
        return carry

    lax.fori_loop(0, out_ref.shape[1] // block_k, body, 0)


def _chunk_wu_kernel(
    len_ref,  # [Bp] int32
    k_ref,  # [C, K]
    v_ref,  # [C, V]
    t_ref,  # [C, 2C] fp32, chunk_intra's scratch: beta/||k||, beta in columns 0, 1; T in C..2C
    gb_ref,  # [C, K] fp32, chunk_diag's block-local cumulative gate
    w_ref,  # [C, K] out
    u_ref,  # [C, V] fp32 out
    *,
    sub,
    block_k,
):
    """One (sequence, chunk, head): w = T (beta k exp(G)), u = T (beta v)."""
    c = k_ref.shape[0]
    seq, chunk_idx = pl.program_id(0), pl.program_id(1)
    row = lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    valid = chunk_idx * c + row < len_ref[seq]

    def g_of(cols):
        return g_from_block_sums(gb_ref, pl.ds(0, c), row, cols, sub=sub)

    def load(ref, cols):  # 0 at pads and past T (whatever the pads hold)
        return plt.load(ref.at[:, cols], mask=valid, other=0.0).astype(f32)

    rows_cc, cols_cc = _rows_and_cols(c)
    # T from the scratch's columns C..2C; blocks above the diagonal are never written (0).
    t_full = plt.load(t_ref.at[:, pl.ds(c, c)], mask=rows_cc // sub >= cols_cc // sub, other=0.0)
    w_scale, u_scale = t_ref[:, pl.ds(0, 1)], t_ref[:, pl.ds(1, 1)]
    _apply_t(t_full, w_ref, lambda cols: w_scale * load(k_ref, cols) * jnp.exp(g_of(cols)), block_k)
    _apply_t(t_full, u_ref, lambda cols: u_scale * load(v_ref, cols), block_k)


def chunk_wu(
    lens, k, v, scratch, gb, *, chunk, sub, mm_dtype, block_k, num_warps, num_stages, interpret
):
    """w and u of every chunk (module docstring).

    Args:
      lens: [Bp] int32, the lengths padded to a power of two; k: [B, T, H, K]; v: [B, T, H, V].
      scratch: `chunk_intra`'s [B, H, N*C, 2C]; gb: `chunk_diag`'s [B, N*C, H, K].
      chunk: C; sub: `chunk_diag`'s rows per block; mm_dtype: dtype of w.
      block_k, num_warps, num_stages: the column slice width and the Triton launch parameters;
      interpret: Pallas interpret mode (resolved).
    Returns:
      w: [B, H, N*C, K] mm_dtype; u: [B, H, N*C, V] fp32.
    """
    bsz, t, h, kd = k.shape
    vd = v.shape[-1]
    n = common.cdiv(t, chunk)
    tp = n * chunk
    return pl.pallas_call(
        functools.partial(_chunk_wu_kernel, sub=sub, block_k=block_k),
        out_shape=(
            jax.ShapeDtypeStruct((bsz, h, tp, kd), mm_dtype),
            jax.ShapeDtypeStruct((bsz, h, tp, vd), f32),
        ),
        grid=(bsz, n, h),
        in_specs=[
            pl.BlockSpec((lens.shape[0],), lambda s, c, hh: (0,)),
            token_spec(chunk, kd),
            token_spec(chunk, vd),
            chunk_spec(chunk, 2 * chunk),
            token_spec(chunk, kd),
        ],
        out_specs=(chunk_spec(chunk, kd), chunk_spec(chunk, vd)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="kda_chunk_wu",
        interpret=interpret,
    )(lens, k, v, scratch, gb)
