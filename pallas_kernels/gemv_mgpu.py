"""The decode step's input projection on Hopper: y = x @ w.T for 1..16 rows, TMA + wgmma.

Mosaic GPU backend. Shapes as in `gemv`: x [M, D] activations, w [N, D] bf16 weight in torch
`[out, in]` layout, y [M, N] bf16 (the block's w_in, [12576, 2304], 58 MB).

One CTA per `block_n` weight rows. `plgpu.emit_pipeline` streams the weight's [block_n, block_k]
tiles and x's [16, block_k] tiles into shared memory by TMA, `steps` tiles in flight; each step
is one wgmma with the weight tile as the 64-row A operand and x, transposed in place, as a
16-column B. x has only M rows: its TMA box reaches past the array's end, so columns M..15 of B
are zero-filled (and their outputs never stored). The accumulator is y^T [block_n, 16] in fp32.
Mosaic GPU lowers no transpose of it (nor a store through a transposed view), so a second
wgmma transposes it: y [64, block_n] = E [64, 16] @ bf16(y^T)^T with E the identity's first 16
columns. That is exact for a bf16 output: each element is bf16(acc) * 1 plus zeros, summed in
fp32 (non-finite values cross it as small integer codes, so a NaN or inf stays in its own row).
A TMA store then writes y's first M rows (a part's ragged last tile through a
shared-memory tile of its own width). On w_in it is faster than the Triton sweep (`gemv`).

Its reference is `reference.gemv_reference` (the projection stage's, bf16 output).

Bits: each column of B is one row of x and wgmma's output columns are independent, and the
tiling depends on (N, D) only, so every M in 1..16 runs the same chain of products and fp32
accumulations per element: a row's bits do not depend on M or on the other rows (what makes
`decode_k` equal k serial `decode`s).

What it serves (`mgpu_fits`, checked): bf16 weights and output, 1 <= M <= 16, D a multiple of
64, part widths that are multiples of 8 and either multiples of 64 or narrower than 64 (Mosaic
GPU's lowering refuses a swizzled TMA copy of 64-column tiles into an array whose minor size is
neither, e.g. w_in as one [M, 12576] array), every part but the last starting at a multiple of
block_n, and at least one 64-row tile per SM (a weight with fewer, such as o_proj, needs its D
split, which the Triton sweep does). `gemv.proj` sends such calls here on Hopper and the rest to
the Triton sweep.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

__all__ = ["MAX_ROWS", "MgpuGemvBlockSizes", "gemv_mgpu", "mgpu_fits"]

MAX_ROWS = 16  # x's rows: the columns of wgmma's B operand (16: bf16's K for the transpose)
_SMS = common.TARGET_PROGRAMS // 2  # the H200's 132 SMs: fewer 64-row tiles leave SMs idle


@dataclasses.dataclass(frozen=True)
class MgpuGemvBlockSizes:
    """Static tiling of one sweep.

    Attributes:
      block_n: weight rows per CTA (wgmma's A operand: a multiple of 64).
      block_k: D columns per pipeline step (a multiple of 64: the 128-byte swizzle of bf16).
      steps: tiles in flight (the pipeline's depth).
    """

    block_n: int = 64
    block_k: int = 128
    steps: int = 4

    def __post_init__(self):
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(
                f"MgpuGemvBlockSizes.block_n={self.block_n}: expected 64, 128, 192 or 256"
            )
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(
                f"MgpuGemvBlockSizes.block_k={self.block_k}: expected a multiple of 64"
            )
        if self.steps < 1:
            raise ValueError(f"MgpuGemvBlockSizes.steps={self.steps}: expected >= 1")

    @staticmethod
    def get_default() -> MgpuGemvBlockSizes:
        """The tiling of every call (`mgpu_fits` is checked against its block_n): one for all
        M, so rows keep their bits across M."""
        return MgpuGemvBlockSizes()


def _widths(n: int, splits) -> tuple[int, ...]:
    return (n,) if splits is None else tuple(int(v) for v in splits)


def mgpu_fits(x_shape, w_shape, w_dtype, out_dtype, splits) -> bool:
    """Whether `gemv_mgpu` serves this call with the default tiling (module docstring)."""
    m, d = x_shape
    n = w_shape[0]
    bf16 = jnp.dtype(jnp.bfloat16)
    widths = _widths(n, splits)
    bounds = common.bounds(widths)
    bn = MgpuGemvBlockSizes.get_default().block_n
    return (
        jnp.dtype(w_dtype) == bf16
        and jnp.dtype(out_dtype or w_dtype) == bf16
        and 1 <= m <= MAX_ROWS
        and d % 64 == 0
        and sum(widths) == n
        and all(w > 0 and w % 8 == 0 and (w % bn == 0 or w < bn) for w in widths)
        and all(b % bn == 0 for b in bounds[1:-1])
        and common.cdiv(n, bn) >= _SMS
    )


def _body(
    x_gmem,  # [M, D] bf16
    w_gmem,  # [N, D] bf16
    *o_gmems,  # [M, n_s] bf16, one per part
    m,
    bs,
    ksteps,
    bounds,
):
    """One CTA: weight rows ni * block_n .. + block_n, all of D."""
    ni = lax.axis_index("n")
    bn, bk = bs.block_n, bs.block_k

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, w_smem, x_smem: plgpu.wgmma(acc_ref, w_smem, x_smem.T),
            grid=(ksteps,),
            in_specs=[
                plgpu.BlockSpec((bn, bk), lambda k: (ni, k)),
                plgpu.BlockSpec((MAX_ROWS, bk), lambda k: (0, k)),
            ],
            max_concurrent_steps=bs.steps,
        )(w_gmem, x_gmem)
        return acc_ref[...]

    yt = pl.run_scoped(acc_scope, plgpu.ACC((bn, MAX_ROWS)))  # y^T, fp32
    widths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    tails = sorted({w % bn for w in widths} - {0})
    bf16 = jnp.bfloat16

    @functools.partial(
        pl.run_scoped,
        t_smem=plgpu.SMEM((bn, MAX_ROWS), bf16),
        c_smem=plgpu.SMEM((bn, MAX_ROWS), bf16),
        e_smem=plgpu.SMEM((64, MAX_ROWS), bf16),
        o_smem=plgpu.SMEM((64, bn), bf16),
        r_smem=[plgpu.SMEM((64, t), bf16) for t in tails],
    )
    def _(t_smem, c_smem, e_smem, o_smem, r_smem):
        # A product with 0 is NaN for a NaN or an inf, so non-finite values would leak into
        # every row of the transpose: they cross it as codes (1: +inf, 2: -inf, 3: NaN; small
        # integers, exact in bf16) and the values as 0, and each row is rebuilt from its own.
        inf = jnp.float32(jnp.inf)
        t = yt.astype(bf16).astype(jnp.float32)
        code = jnp.where(t != t, 3.0, jnp.where(t == inf, 1.0, jnp.where(t == -inf, 2.0, 0.0)))
        t_smem[...] = jnp.where(code == 0.0, t, 0.0).astype(bf16)
        c_smem[...] = code.astype(bf16)
        rows = lax.broadcasted_iota(jnp.int32, (64, MAX_ROWS), 0)
        cols = lax.broadcasted_iota(jnp.int32, (64, MAX_ROWS), 1)
        e_smem[...] = (rows == cols).astype(bf16)
        plgpu.commit_smem()

        def transpose(src, acc_ref):
            plgpu.wgmma(acc_ref, e_smem, src.T)
            return acc_ref[...]

        y = pl.run_scoped(functools.partial(transpose, t_smem), plgpu.ACC((64, bn)))
        yc = pl.run_scoped(functools.partial(transpose, c_smem), plgpu.ACC((64, bn)))
        bad = jnp.where(yc == 1.0, inf, jnp.where(yc == 2.0, -inf, jnp.float32(jnp.nan)))
        y = jnp.where(yc == 0.0, y, bad).astype(bf16)  # rows >= m are zero

        def whole(o_gmem, t0):
            o_smem[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, m)], o_gmem.at[:, pl.ds((ni - t0) * bn, bn)])

        def ragged(o_gmem, full, tail):
            r_ref = r_smem[tails.index(tail)]
            r_ref[...] = y[:, :tail]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(r_ref.at[pl.ds(0, m)], o_gmem.at[:, pl.ds(full * bn, tail)])

        # The CTA's rows fall in one part (every inner bound is a multiple of block_n); a part
        # whose width is not a multiple of block_n ends in a ragged tile, stored at its width.
        for o_gmem, lo, width in zip(o_gmems, bounds[:-1], widths, strict=True):
            t0, full, tail = lo // bn, width // bn, width % bn
            pl.when((ni >= t0) & (ni < t0 + full))(functools.partial(whole, o_gmem, t0))
            if tail:
                pl.when(ni == t0 + full)(functools.partial(ragged, o_gmem, full, tail))
        plgpu.wait_smem_to_gmem(0)


def gemv_mgpu(
    x: jax.Array,
    w: jax.Array,
    *,
    splits: tuple[int, ...] | None = None,
    block_sizes: MgpuGemvBlockSizes | None = None,
    interpret: bool | None = None,
):
    """y = x @ w.T in bf16, fp32 accumulation, for 1 <= M <= 16 rows (module docstring).

    Args:
      x: [M, D] float activations (cast to bf16 first, as the reference does).
      w: [N, D] bf16 weight.
      splits: widths summing to N: y comes back as that many arrays (columns of y in order),
        each stored by the kernel.
      block_sizes: tiling (default `MgpuGemvBlockSizes.get_default()`, the same for every M).
      interpret: run in Mosaic GPU's interpreter (None: when there is no GPU).
    Returns:
      [M, N] bf16, or a tuple of [M, n_s] when `splits` is given.
    """
    if (
        x.ndim != 2
        or w.ndim != 2
        or w.shape[1] != x.shape[1]
        or not mgpu_fits(x.shape, w.shape, w.dtype, None, splits)
    ):
        raise ValueError(
            f"gemv_mgpu: x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}, splits {splits}: "
            f"expected bf16 w [N, D] with N >= {_SMS} x 64, x [M, D] with 1 <= M <= {MAX_ROWS}, "
            "D % 64 == 0, and part widths multiples of 8, each a multiple of 64 or below 64"
        )
    bs = block_sizes or MgpuGemvBlockSizes.get_default()
    widths = _widths(w.shape[0], splits)
    bounds = common.bounds(widths)
    if any(b % bs.block_n for b in bounds[1:-1]):
        raise ValueError(f"block_n={bs.block_n} must divide every split bound {bounds[1:-1]}")
    m, d = x.shape
    kw = dict(m=m, bs=bs, ksteps=common.cdiv(d, bs.block_k), bounds=bounds)

    def kda_gemv_mgpu(*refs):  # the kernel's name in profiles
        _body(*refs, **kw)

    parts = plgpu.kernel(
        kda_gemv_mgpu,
        out_type=tuple(jax.ShapeDtypeStruct((m, wd), jnp.bfloat16) for wd in widths),
        grid=(common.cdiv(w.shape[0], bs.block_n),),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if common.resolve_interpret(interpret) else None,
    )(x.astype(jnp.bfloat16), w)
    return parts[0] if splits is None else tuple(parts)
