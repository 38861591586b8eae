"""Decode projections on Hopper: y = x @ w.T for 1..64 rows with TMA and wgmma (Mosaic GPU).

Shapes as in `gemv`: x [M, D] bf16 activations, w [N, D] bf16 weight in torch `[out, in]` layout,
y [M, N]. One CTA per `block_n` weight rows (and D range, when split): `plgpu.emit_pipeline`
streams the weight's [block_n, block_k] tiles and x's [64, block_k] tiles into shared memory by
TMA, `steps` tiles in flight, and each step is one wgmma with x as the 64-row A operand and the
weight tile, transposed in place, as B. x has only M rows: the TMA box reaches past the array's
end, so rows M..63 of the A tile are zero-filled and never stored. The [64, block_n] fp32
accumulator goes through shared memory to y by a TMA store of its first M rows (the box is
clipped at y's bounds too, so a ragged last weight tile stores only its real columns).

Why x is A and not B: wgmma's A operand is 64 rows, its B operand as few as 8 columns, so the
weight as A (x as an 8-column B) does an eighth of the tensor-core work; but its accumulator is
y^T, and storing y as [M, N] from it needs a transpose that Mosaic GPU does not lower. With x as
A the accumulator is y itself; the extra tensor-core work overlaps the weight's stream.

Bits: a row of the accumulator depends only on its own row of A, and the tiling depends on
(N, D) only, so every M in 1..64 runs the same chain of products and fp32 accumulations per
element: a row's bits do not depend on M or on the other rows (what makes `decode_k` equal k
serial `decode`s, for every B * k <= 64).

Split reduction (o_proj [2304, 4096]: 36 row tiles): D is split into `split_d` contiguous ranges
on a second grid axis, each CTA stores fp32 partial sums [split_d, M, N], and the partials are
added afterwards in a fixed left-to-right order, elementwise (the same chain for every row).

Limits (checked): bf16 only; TMA needs every row stride to be a multiple of 16 bytes, so D must
be a multiple of 8 and each output part's width a multiple of 16 bytes in its dtype; every part
but the last must start at a multiple of block_n. `gemv.proj` sends the calls that fit here on
Hopper and the rest to the Triton sweep (`mgpu_fits`).
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

__all__ = ["MgpuGemvBlockSizes", "gemv_mgpu", "mgpu_fits"]

_ROWS = 64  # wgmma's A operand: 64 rows, x's M rows padded by the TMA box
MAX_ROWS = _ROWS


@dataclasses.dataclass(frozen=True)
class MgpuGemvBlockSizes:
    """Static tiling of one sweep.

    Attributes:
      block_n: weight rows per CTA (wgmma's N: a multiple of 8, at most 256).
      block_k: D columns per pipeline step (a multiple of 16: wgmma's K for bf16; 64 gives the
        128-byte swizzle).
      steps: tiles in flight (the pipeline's depth).
      split_d: contiguous D ranges reduced by separate CTAs (1: no split); the D steps must
        divide evenly among them.
    """

    block_n: int = 64
    block_k: int = 128
    steps: int = 4
    split_d: int = 1

    def __post_init__(self):
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"block_n={self.block_n}: expected a multiple of 8 in [8, 256]")
        if self.block_k % 16 or self.block_k < 16:
            raise ValueError(f"block_k={self.block_k}: expected a multiple of 16")
        if self.steps < 1 or self.split_d < 1:
            raise ValueError(f"steps={self.steps}, split_d={self.split_d}: expected >= 1")

    @classmethod
    def default_for(cls, n: int, d: int, bounds=None) -> MgpuGemvBlockSizes:
        """Tiling for w [n, d] whatever M is (1..64: the rows' bits must not depend on M).
        - block_n: 64 (wgmma's native tile) unless a part bound needs fewer rows;
        - block_k: 128 (a [64, 128] bf16 tile is 16 KB; four in flight per operand);
        - split_d: a weight with fewer than two row tiles per SM (o_proj, 36 tiles) splits D
          until it has ~4 CTAs per SM, as long as the D steps divide.
        """
        block_n = 64
        inner = () if bounds is None else bounds[1:-1]
        while block_n > 8 and any(b % block_n for b in inner):
            block_n //= 2
        block_k = min(128, max(16, common.next_pow2(d)))
        tiles, ksteps, split_d = common.cdiv(n, block_n), common.cdiv(d, block_k), 1
        while tiles * split_d < 4 * 132 and tiles < 132 and ksteps % (2 * split_d) == 0:
            split_d *= 2
        return cls(block_n=block_n, block_k=block_k, split_d=split_d)


def _widths(n: int, splits) -> tuple[int, ...]:
    return (n,) if splits is None else tuple(int(v) for v in splits)


def mgpu_fits(x_shape, w_shape, w_dtype, out_dtype, splits) -> bool:
    """Whether `gemv_mgpu` serves this call: bf16 weights, 1 <= M <= 64, and every row stride
    a multiple of 16 bytes for TMA (D % 8 == 0; each output part's width in out_dtype, or in
    fp32 for split partial sums)."""
    m, d = x_shape
    n = w_shape[0]
    if jnp.dtype(w_dtype) != jnp.bfloat16 or not 1 <= m <= MAX_ROWS or d % 8:
        return False
    bs = MgpuGemvBlockSizes.default_for(n, d, common.bounds(_widths(n, splits)))
    item = 4 if bs.split_d > 1 else jnp.dtype(out_dtype or w_dtype).itemsize
    return all(w * item % 16 == 0 for w in _widths(n, splits))


def _body(x_gmem, w_gmem, *o_gmems, m, bs, ksteps, bounds, part_dtype):
    """One CTA: weight rows ni * block_n .. + block_n over D steps si * ksteps .. + ksteps."""
    ni, si = lax.axis_index("n"), lax.axis_index("s")
    bn, bk = bs.block_n, bs.block_k
    k0 = si * ksteps

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem.T),
            grid=(ksteps,),
            in_specs=[
                plgpu.BlockSpec((_ROWS, bk), lambda k: (0, k0 + k)),
                plgpu.BlockSpec((bn, bk), lambda k: (ni, k0 + k)),
            ],
            max_concurrent_steps=bs.steps,
        )(x_gmem, w_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_ROWS, bn)))

    widths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    tails = sorted({w % bn for w in widths} - {0})

    @functools.partial(
        pl.run_scoped,
        o_smem=plgpu.SMEM((_ROWS, bn), part_dtype),
        t_smem=[plgpu.SMEM((_ROWS, t), part_dtype) for t in tails],
    )
    def _(o_smem, t_smem):
        def whole(o_gmem, t0):
            o_smem[...] = acc.astype(part_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(0, m)], o_gmem.at[si, :, pl.ds((ni - t0) * bn, bn)]
            )

        def ragged(o_gmem, full, tail):
            t_ref = t_smem[tails.index(tail)]
            t_ref[...] = acc[:, :tail].astype(part_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_ref.at[pl.ds(0, m)], o_gmem.at[si, :, pl.ds(full * bn, tail)])

        # The CTA's rows fall in one part (every inner bound is a multiple of block_n). A part
        # whose width is not a multiple of block_n ends in a ragged tile: its first `tail`
        # columns go through a shared-memory tile of their own, so the store box is whole.
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
    out_dtype=None,
    splits: tuple[int, ...] | None = None,
    block_sizes: MgpuGemvBlockSizes | None = None,
):
    """y = x @ w.T, fp32 accumulation, for 1 <= M <= 64 rows (module docstring).

    Args:
      x: [M, D] float activations (cast to bf16 first, as the reference does).
      w: [N, D] bf16 weight.
      out_dtype: dtype of y (default bf16).
      splits: widths summing to N: y comes back as that many arrays (columns of y in order),
        each stored by the kernel; every part but the last starts at a multiple of block_n.
      block_sizes: tiling (default `MgpuGemvBlockSizes.default_for`, the same for every M).
    Returns:
      [M, N] out_dtype, or a tuple of [M, n_s] when `splits` is given.
    """
    m, d = x.shape
    n = w.shape[0]
    out_dtype = jnp.dtype(out_dtype or w.dtype)
    if not mgpu_fits(x.shape, w.shape, w.dtype, out_dtype, splits) or w.shape[1] != d:
        raise ValueError(
            f"gemv_mgpu: x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}, out {out_dtype}, "
            f"splits {splits}: expected bf16 w [N, D], x [M, D] with 1 <= M <= {MAX_ROWS}, "
            "D % 8 == 0 and part widths of whole 16-byte rows"
        )
    widths = _widths(n, splits)
    bounds = common.bounds(widths)
    if sum(widths) != n or min(widths) < 1:
        raise ValueError(f"gemv_mgpu: splits={splits}: expected positive widths summing to N={n}")
    bs = block_sizes or MgpuGemvBlockSizes.default_for(n, d, bounds)
    if any(b % bs.block_n for b in bounds[1:-1]):
        raise ValueError(f"block_n={bs.block_n} must divide every split bound {bounds[1:-1]}")
    ksteps = common.cdiv(d, bs.block_k)
    if ksteps % bs.split_d:
        raise ValueError(f"split_d={bs.split_d} must divide the {ksteps} D steps of {bs.block_k}")
    part_dtype = out_dtype if bs.split_d == 1 else jnp.dtype(jnp.float32)
    parts = plgpu.kernel(
        functools.partial(
            _body,
            m=m,
            bs=bs,
            ksteps=ksteps // bs.split_d,
            bounds=bounds,
            part_dtype=part_dtype,
        ),
        out_type=tuple(jax.ShapeDtypeStruct((bs.split_d, m, wd), part_dtype) for wd in widths),
        grid=(common.cdiv(n, bs.block_n), bs.split_d),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if common.interpret() else None,
    )(x.astype(jnp.bfloat16), w)
    out = []
    for p in parts:
        y = p[0]
        for i in range(1, bs.split_d):
            y = y + p[i]
        out.append(y.astype(out_dtype))
    return out[0] if splits is None else tuple(out)
