"""Sigmoid-gated RMSNorm of the core output (SPEC §1, `y_h`), one head per row.

`y_h = o_h * rsqrt(mean_d o_h^2 + eps) * w * sigmoid(z_h)`, fp32 math and one cast at the end.
Rows are (sequence, token, head) triples flattened to `N = prod(lead) * H` rows of `V` values;
each program normalises a tile of `block_rows` whole rows, so the mean never crosses programs.
`decode_core` fuses the same epilogue into the recurrent kernel when its V tile covers a whole
head (`recurrent.py`); this kernel serves the prefill path and the split-V decode.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

__all__ = ["ONormBlockSizes", "o_norm"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ONormBlockSizes:
    """Tiling of `o_norm`.

    Attributes:
      block_rows: rows (heads) per program, a power of two dividing the row count N.
      num_warps: Triton warps per program.
    """

    block_rows: int
    num_warps: int = 4

    @staticmethod
    def get_default(n_rows: int, v: int) -> ONormBlockSizes:
        """Up to 8K values per program (a power of two dividing n_rows), halved while that
        leaves fewer than two programs per SM: small row counts (a decode step's 32 heads) get
        one-row programs, which fill more SMs. Warps follow the tile: 1024 values per warp,
        1 to 4."""
        block_rows = min(max(1, 8192 // v), n_rows & -n_rows)
        while block_rows > 1 and n_rows // block_rows < common.TARGET_PROGRAMS:
            block_rows //= 2
        return ONormBlockSizes(block_rows, num_warps=max(1, min(4, block_rows * v // 1024)))


def gated_rms_norm(o, z, w, eps: float):
    """The fp32 epilogue shared with the fused recurrent kernel.

    o, z: [..., V] fp32 rows (one head each); w: [V] fp32. Returns fp32 of o's shape.
    """
    inv = jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    return o * inv * w * jax.nn.sigmoid(z)


def _o_norm_kernel(
    o_ref,  # [block_rows, V]
    z_ref,  # [block_rows, V]
    w_ref,  # [V]
    *refs,  # keep_ref [block_rows] fp32 (only with `keep`), y_ref [block_rows, V]
    eps: float,
):
    *keep_ref, y_ref = refs
    o = o_ref[...].astype(f32)
    z = z_ref[...].astype(f32)
    w = w_ref[...].astype(f32)
    y = gated_rms_norm(o, z, w[None, :], eps)
    if keep_ref:
        keep = keep_ref[0][...][:, None]
        y = jnp.where(keep == 1.0, y, keep)
    y_ref[...] = y.astype(y_ref.dtype)


def o_norm(
    o: jax.Array,
    z: jax.Array,
    w: jax.Array,
    *,
    eps: float,
    keep: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    block_sizes: ONormBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Sigmoid-gated RMSNorm per head; the kernel of `reference.o_norm_reference`.

    Args:
      o: [..., H, V] core output (fp32; any float dtype is read as fp32).
      z: [..., H*V] output-gate projection, any float dtype.
      w: [V] norm weight.
      eps: the RMSNorm epsilon (cfg.rms_norm_eps).
      keep: optional [...] fp32 per token: 1 keeps the norm, any other value replaces the
        token's output (0 at pads, NaN after a non-finite token), whatever o and z hold there.
      out_dtype: dtype of the result.
      block_sizes: tiling (default `ONormBlockSizes.get_default(N, V)`).
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      [..., H*V] out_dtype.
    """
    *lead, h, v = o.shape
    if tuple(z.shape) != (*lead, h * v):
        raise ValueError(
            f"o_norm: z has shape {tuple(z.shape)}, expected {(*lead, h * v)} for o {o.shape}"
        )
    if tuple(w.shape) != (v,):
        raise ValueError(f"o_norm: w has shape {tuple(w.shape)}, expected ({v},)")
    if v & (v - 1):
        raise ValueError(f"o_norm: V={v} must be a power of two (one head per Triton row)")
    n = math.prod(lead) * h
    if n == 0:
        return jnp.zeros((*lead, h * v), out_dtype)
    blk = block_sizes or ONormBlockSizes.get_default(n, v)
    if blk.block_rows & (blk.block_rows - 1) or n % blk.block_rows:
        raise ValueError(
            f"o_norm: block_rows={blk.block_rows}: expected a power of two dividing N={n} rows"
        )
    rows = lambda a: a.reshape(n, v)  # noqa: E731
    spec = pl.BlockSpec((blk.block_rows, v), lambda i: (i, 0))
    extra, extra_specs = (), []
    if keep is not None:
        if tuple(keep.shape) != tuple(lead):
            raise ValueError(f"o_norm: keep has shape {tuple(keep.shape)}, expected {tuple(lead)}")
        extra = (jnp.broadcast_to(keep.astype(f32)[..., None], (*lead, h)).reshape(n),)
        extra_specs = [pl.BlockSpec((blk.block_rows,), lambda i: (i,))]
    y = pl.pallas_call(
        lambda *refs: _o_norm_kernel(*refs, eps=eps),
        out_shape=jax.ShapeDtypeStruct((n, v), out_dtype),
        grid=(n // blk.block_rows,),
        in_specs=[spec, spec, pl.BlockSpec((v,), lambda i: (0,)), *extra_specs],
        out_specs=spec,
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=1),
        name="kda_o_norm",
        interpret=common.resolve_interpret(interpret),
    )(rows(o), rows(z), w, *extra)
    return y.reshape(*lead, h * v)
