"""The decode step's second launch: conv_decode and the f_b | g_b projections in one grid.

Both read w_in's output and nothing of each other's, and at decode sizes each is a few
microseconds, mostly launch latency. `decode_front` runs them side by side in one launch: a
1-D grid whose first programs are conv_decode's (`conv.plan_decode`) and whose others are the
sweep's (`gemv.plan`). Every program runs the code its own launch would run, with the same tiling:
compiled, the results have the bits of `conv_decode` and `proj_many` launched apart
(test_front.py), and R rows per sequence still give the bits of R serial 1-row calls. Past the
sweep's largest row tile (M > `gemv.MAX_TILE_ROWS` rows) the two run apart: `conv_decode` and
`proj_many`'s XLA dots, which suit a product of that many rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import conv, gemv
from pallas_kernels import reference as ref

__all__ = ["decode_front"]


def decode_front(
    x: jax.Array,
    conv_state: jax.Array,
    w: jax.Array,
    xs,
    ws,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    splits: tuple[int, ...] | None = None,
    snapshots: bool = False,
    out_dtype=None,
    slots: jax.Array | None = None,
    biases=None,
    interpret: bool | None = None,
):
    """conv_decode(x, conv_state, w, ...) and proj_many(xs, ws) in one launch; the kernel of
    `reference.decode_front_reference`.

    Args:
      x, conv_state, w, qk_channels, head_dim, l2_eps, splits, snapshots, slots: as
        `conv.conv_decode` (x [B, R, C] raw q|k|v rows, conv_state [B, W-1, C] fp32, or with
        slots a pool [N, W-1, C], written over in place when the caller donates it).
      xs, ws: as `gemv.proj_many`: activations [M, D] (M >= 1; one launch for M <= 64) and
        weights [N, D] of one shape each (the block's f_a, g_a and f_b, g_b).
      out_dtype: dtype of the projections (default: the weights').
      biases: as `gemv.proj_many`: None or one entry (None or [N]) per weight, added in fp32.
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Both parts take their own launches' default tilings (what keeps their bits).
    Returns:
      (out or its segments, new_state, states | None, ys): conv_decode's three results, then
      the tuple of projections [M, N].
    """
    kw = dict(qk_channels=qk_channels, head_dim=head_dim, l2_eps=l2_eps, splits=splits)
    kw.update(snapshots=snapshots, slots=slots, interpret=interpret)
    if xs and xs[0].ndim == 2 and xs[0].shape[0] > gemv.MAX_TILE_ROWS:
        ys = gemv.proj_many(xs, ws, out_dtype=out_dtype, biases=biases, interpret=interpret)
        return (*conv.conv_decode(x, conv_state, w, **kw), ys)
    cp = conv.plan_decode(x, conv_state, w, flat=True, **kw)
    biases = ref.proj_many_biases(biases, tuple(ws))
    out_dtype = jnp.dtype(out_dtype or ws[0].dtype)
    acc = out_dtype if all(b is None for b in biases) else jnp.float32
    sp = gemv.plan(xs, ws, out_dtype=acc, what="decode_front")
    warps = sp.block_sizes.num_warps
    if cp.num_warps != warps:
        raise ValueError(
            f"decode_front: the conv tiling has {cp.num_warps} warps and the sweep's {warps}; "
            "one launch needs one warp count"
        )
    n_conv = cp.programs
    _, split_d, groups = sp.grid
    n_in, n_out = len(cp.inputs), len(cp.out_shape)
    whole = pl.no_block_spec

    def kernel(*refs):
        ins, outs = refs[: n_in + len(sp.inputs)], refs[n_in + len(sp.inputs) :]
        conv_refs, sweep_refs = (*ins[:n_in], *outs[:n_out]), (*ins[n_in:], *outs[n_out:])
        # Ids are read here: interpret mode cannot see program_id inside pl.when.
        p = pl.program_id(0)
        _, j, slot = cp.flat_ids(p)
        q = jnp.maximum(p - n_conv, 0)
        ids = (q // (split_d * groups), (q // groups) % split_d, q % groups)
        pl.when(p < n_conv)(lambda: cp.program(conv_refs, j, slot))
        pl.when(p >= n_conv)(lambda: sp.program(sweep_refs, ids))

    res = pl.pallas_call(
        kernel,
        out_shape=(*cp.out_shape, *sp.out_shape),
        grid=(n_conv + math.prod(sp.grid),),
        in_specs=(*cp.in_specs, *([whole] * len(sp.inputs))),
        out_specs=(*cp.out_specs, *([whole] * len(sp.out_shape))),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=sp.block_sizes.num_stages),
        input_output_aliases={1: cp.state_output},
        name="kda_decode_front",
        interpret=cp.interpret,
    )(*cp.inputs, *sp.inputs)
    out, new_state, states = cp.finish(res[:n_out])
    ys = sp.finish(res[n_out:])
    ys = tuple(ref.add_bias(y, b, out_dtype) for y, b in zip(ys, biases, strict=True))
    return out, new_state, states, ys
