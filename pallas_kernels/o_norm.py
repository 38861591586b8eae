"""Sigmoid-gated RMSNorm of the core output (SPEC §1, `y_h`), one head per row.

`y_h = o_h * rsqrt(mean_d o_h^2 + eps) * w * sigmoid(z_h)`, fp32 math and one cast at the end.
`o_norm` reads a materialised z: rows are (sequence, token, head) triples flattened to
`N = prod(lead) * H` rows of `V` values, each program normalising `block_rows` whole rows, so the
mean never crosses programs (the split-V decode). `o_norm_gate` serves the prefill: it forms
z = g_a g_b^T (+ bias) for its [block_t, V] tile of one head itself, so z's [B, T, P] is never
written or read. `decode_core` fuses the same epilogue into the recurrent kernel when its V
tile covers a whole head (`recurrent.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

__all__ = ["ONormBlockSizes", "o_norm", "o_norm_gate"]

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
    def get_default(n_rows: int, v: int, group: int | None = None) -> ONormBlockSizes:
        """Up to 8K values per program (a power of two dividing n_rows, and `group` when
        given), halved while that leaves fewer than two programs per SM: small row counts (a
        decode step's 32 heads) get one-row programs, which fill more SMs. Warps follow the
        tile: 1024 values per warp, 1 to 4."""
        g = group or n_rows
        block_rows = min(max(1, 8192 // v), n_rows & -n_rows, g & -g)
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
    *refs,  # code_ref [1] int32 (only with `slots`), y_ref [block_rows, V]
    eps: float,
):
    *code_ref, y_ref = refs
    o = o_ref[...].astype(f32)
    z = z_ref[...].astype(f32)
    w = w_ref[...].astype(f32)
    y = gated_rms_norm(o, z, w[None, :], eps)
    if code_ref:
        code = code_ref[0][...][:, None]
        y = jnp.where(code >= 0, y, jnp.where(code == -1, 0.0, jnp.nan))
    y_ref[...] = y.astype(y_ref.dtype)


def o_norm(
    o: jax.Array,
    z: jax.Array,
    w: jax.Array,
    *,
    eps: float,
    slots: jax.Array | None = None,
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
      slots: optional [B] int32 slot codes, one per leading row of o (a pool's decode): the
        outputs of a row with a negative code are `reference.slot_fill`'s (0 for -1, NaN
        below), whatever o and z hold there. Read by each program itself: no broadcast first.
      out_dtype: dtype of the result.
      block_sizes: tiling (default `ONormBlockSizes.get_default(N, V)`, with `slots` capped
        at one leading row per program).
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
    if slots is not None and (not lead or tuple(slots.shape) != (lead[0],)):
        raise ValueError(
            f"o_norm: slots has shape {tuple(slots.shape)}, expected ({lead[0] if lead else 1},) "
            f"(one code per leading row of o {o.shape})"
        )
    n = math.prod(lead) * h
    if n == 0:
        return jnp.zeros((*lead, h * v), out_dtype)
    per_row = n // lead[0] if slots is not None else n  # rows a program may not straddle
    blk = block_sizes or ONormBlockSizes.get_default(n, v, group=per_row)
    if blk.block_rows & (blk.block_rows - 1) or per_row % blk.block_rows:
        what = f"the {per_row} rows of one slot" if slots is not None else f"N={n} rows"
        raise ValueError(
            f"o_norm: block_rows={blk.block_rows}: expected a power of two dividing {what}"
        )
    rows = lambda a: a.reshape(n, v)  # noqa: E731
    spec = pl.BlockSpec((blk.block_rows, v), lambda i: (i, 0))
    extra, extra_specs = (), []
    if slots is not None:
        progs = per_row // blk.block_rows  # programs per leading row
        extra = (slots.astype(jnp.int32),)
        extra_specs = [pl.BlockSpec((1,), lambda i: (i // progs,))]
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


def _o_norm_gate_kernel(
    o_ref,  # [block_t, V] of one head
    ga_ref,  # [block_t, R]
    gb_ref,  # [V, R]: the head's rows of g_b
    w_ref,  # [V]
    keep_ref,  # [block_t] fp32
    *refs,  # bias_ref [V] (only with a bias), y_ref [block_t, V]
    t: int,
    eps: float,
):
    *bias_ref, y_ref = refs
    bt = o_ref.shape[0]
    rows = pl.program_id(1) * bt + lax.broadcasted_iota(jnp.int32, (bt,), 0)
    inside = (rows < t)[:, None]  # the last tile may run past T: masked loads, masked store
    tile = jnp.broadcast_to(inside, y_ref.shape)
    o = plt.load(o_ref, mask=tile, other=0.0).astype(f32)
    ga = plt.load(ga_ref, mask=jnp.broadcast_to(inside, ga_ref.shape), other=0.0)
    gb = gb_ref[...]
    hi = gb.dtype == jnp.float32  # fp32 weights: IEEE products, as the projections have
    z = lax.dot_general(
        ga.astype(gb.dtype),
        gb,
        (((1,), (1,)), ((), ())),
        preferred_element_type=f32,
        precision=lax.Precision.HIGHEST if hi else None,
    )
    if bias_ref:
        z = z + bias_ref[0][...].astype(f32)[None, :]
    y = gated_rms_norm(o, z, w_ref[...].astype(f32)[None, :], eps)
    keep = plt.load(keep_ref, mask=rows < t, other=0.0)[:, None]
    y = jnp.where(keep == 1.0, y, keep)
    plt.store(y_ref, y.astype(y_ref.dtype), mask=tile)


def o_norm_gate(
    o: jax.Array,
    g_a: jax.Array,
    g_b: jax.Array,
    w: jax.Array,
    keep: jax.Array,
    *,
    eps: float,
    g_bias: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    block_t: int | None = None,
    num_warps: int = 8,
    interpret: bool | None = None,
) -> jax.Array:
    """`o_norm` with the output gate's projection inside: z = g_a @ g_b.T (+ g_bias) in fp32.

    Args:
      o: [B, T, H, V] core output (any float dtype, read as fp32).
      g_a: [B, T, R] the gate's down-projection; g_b: [H*V, R] its up-projection weight;
        g_bias: optional [H*V].
      w: [V] norm weight; keep: [B, T] fp32 as in `o_norm` (1 keeps the norm, any other value
        replaces the token's output, whatever o and g_a hold there).
      block_t: tokens per program, a power of two >= 16 (default: 64, or T rounded up to a
        power of two when shorter); num_warps: Triton warps per program (8: faster than 4 at
        block_t = 64 on an H100).
    Returns:
      [B, T, H*V] out_dtype.
    """
    bsz, t, h, v = o.shape
    r = g_a.shape[-1]
    if tuple(g_a.shape) != (bsz, t, r) or tuple(g_b.shape) != (h * v, r):
        raise ValueError(
            f"o_norm_gate: g_a {tuple(g_a.shape)} and g_b {tuple(g_b.shape)}, expected "
            f"{(bsz, t, 'R')} and {(h * v, 'R')} for o {tuple(o.shape)}"
        )
    for name, d in (("V", v), ("R", r)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"o_norm_gate: {name}={d} must be a power of two >= 16 (a Triton dot)")
    if tuple(w.shape) != (v,) or tuple(keep.shape) != (bsz, t):
        raise ValueError(
            f"o_norm_gate: w {tuple(w.shape)} and keep {tuple(keep.shape)}, expected ({v},) and "
            f"{(bsz, t)}"
        )
    if g_bias is not None and tuple(g_bias.shape) != (h * v,):
        raise ValueError(
            f"o_norm_gate: g_bias has shape {tuple(g_bias.shape)}, expected ({h * v},)"
        )
    if bsz * t == 0:
        return jnp.zeros((bsz, t, h * v), out_dtype)
    bt = block_t or min(64, max(16, pl.next_power_of_2(t)))
    if bt < 16 or bt & (bt - 1):
        raise ValueError(f"o_norm_gate: block_t={bt}: expected a power of two >= 16")
    bias, bias_spec = (), []
    if g_bias is not None:
        bias, bias_spec = (g_bias,), [pl.BlockSpec((v,), lambda s, i, hh: (hh,))]
    return pl.pallas_call(
        functools.partial(_o_norm_gate_kernel, t=t, eps=eps),
        out_shape=jax.ShapeDtypeStruct((bsz, t, h * v), out_dtype),
        grid=(bsz, common.cdiv(t, bt), h),
        in_specs=[
            pl.BlockSpec((None, bt, None, v), lambda s, i, hh: (s, i, hh, 0)),
            pl.BlockSpec((None, bt, r), lambda s, i, hh: (s, i, 0)),
            pl.BlockSpec((v, r), lambda s, i, hh: (hh, 0)),
            pl.BlockSpec((v,), lambda s, i, hh: (0,)),
            pl.BlockSpec((None, bt), lambda s, i, hh: (s, i)),
            *bias_spec,
        ],
        out_specs=pl.BlockSpec((None, bt, v), lambda s, i, hh: (s, i, hh)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kda_o_norm_gate",
        interpret=common.resolve_interpret(interpret),
    )(o, g_a, g_b, w, keep.astype(f32), *bias)
