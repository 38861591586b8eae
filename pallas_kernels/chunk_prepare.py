"""Intra-chunk stage of the chunked prefill (SPEC §5, steps 1-3): everything that needs no state.

For every (sequence, chunk, head) it turns the chunk's q, k, v, raw gate input f and beta
logits into what the state pass (`chunk_scan`) needs, so that pass does four matrix products
per chunk and nothing else:

    g       = gate(f), beta = sigmoid(b)         0 at pads (t >= lengths[b]), whatever they hold
    G       = chunk-local inclusive cumsum of g  [C, K] fp32, G <= 0, decreasing
    A[i,j]  = s sum_d q_i k_j exp(G_i - G_j)     j <= i          (q-k scores)
    L[i,j]  = beta_i sum_d k_i k_j exp(G_i - G_j) j < i          (k-k, strictly lower)
    T       = (I + L)^-1
    w       = T (beta * k * exp(G)),  u = T (beta * v)
    qg      = s q exp(G),  kg = k exp(G_last - G),  gl = exp(G_last)

in three kernels, each launched with the occupancy its registers allow:
  1. `chunk_diag`:  per block of `sub` rows, the diagonal blocks of A and T (exact at any decay
                    strength), the block-local cumulative gate and the rows' inverse norms;
  2. `chunk_intra`: per chunk, qg, kg, gl, the rest of A, and T;
  3. `chunk_wu`:    per chunk, w and u.
Every exponent evaluated is <= 0 (SPEC §5, overflow hazard): each kernel file says how.

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

from pallas_kernels import common
from pallas_kernels.chunk_diag import chunk_diag
from pallas_kernels.chunk_intra import chunk_intra
from pallas_kernels.chunk_wu import chunk_wu

__all__ = ["ChunkIntermediates", "PrepareBlockSizes", "chunk_prepare"]


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
    """Tiling of `chunk_prepare`'s three kernels.

    Attributes:
      sub: rows of a `chunk_diag` block and of `chunk_intra`'s sub-blocks (16: the smallest
        Triton dot side); divides the chunk.
      block_k: width of the K (and V) column slices `chunk_intra` loops over; a power of two
        >= 16 dividing K and V.
      num_warps, num_stages: `chunk_intra`'s Triton warps per program and software-pipelining
        depth of its slice loops.
      diag_warps: Triton warps per program of `chunk_diag` (1: many small programs per SM).
      wu_block_k, wu_warps, wu_stages: block_k, num_warps and num_stages of `chunk_wu`.
    The defaults are the fastest measured on the H200 at the Kimi-Linear geometry.
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
    def get_default(k: int, v: int) -> PrepareBlockSizes:
        """The defaults, with both kernels' slices no wider than K and V (powers of two >= 16)."""
        d = PrepareBlockSizes
        return d(
            block_k=min(d.block_k, k, v),
            wu_block_k=min(d.wu_block_k, k, v),
        )


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


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "chunk",
        "lower_bound",
        "mm_dtype",
        "l2_eps",
        "block_sizes",
        "interpret",
    ),
)
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
    block_sizes: PrepareBlockSizes | None = None,
    interpret: bool | None = None,
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
      block_sizes: tiling (default `PrepareBlockSizes.get_default(K, V)`).
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      ChunkIntermediates with N = ceil(T / C) chunks per sequence.
    """
    blk = block_sizes or PrepareBlockSizes.get_default(q.shape[-1], v.shape[-1])
    _check_shapes(q, k, v, f, b, lengths, a_log, dt_bias, chunk, blk)
    interpret = common.resolve_interpret(interpret)
    bsz = q.shape[0]
    lens = jnp.zeros((common.next_pow2(bsz),), jnp.int32).at[:bsz].set(lengths.astype(jnp.int32))
    diag = chunk_diag(
        lens,
        q,
        k,
        f,
        b,
        a_log,
        dt_bias,
        chunk=chunk,
        sub=blk.sub,
        lower_bound=lower_bound,
        l2_eps=l2_eps,
        num_warps=blk.diag_warps,
        interpret=interpret,
    )
    qg, kg, a, gl, scratch = chunk_intra(
        lens,
        q,
        k,
        b,
        diag,
        chunk=chunk,
        scale=scale,
        l2_eps=l2_eps,
        mm_dtype=mm_dtype,
        block_k=blk.block_k,
        num_warps=blk.num_warps,
        num_stages=blk.num_stages,
        interpret=interpret,
    )
    w, u = chunk_wu(
        lens,
        k,
        v,
        scratch,
        diag.gb,
        chunk=chunk,
        sub=blk.sub,
        mm_dtype=mm_dtype,
        block_k=blk.wu_block_k,
        num_warps=blk.wu_warps,
        num_stages=blk.wu_stages,
        interpret=interpret,
    )
    return ChunkIntermediates(qg=qg, kg=kg, w=w, u=u, a=a, gl=gl)
