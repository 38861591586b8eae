import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

f32 = jnp.float32


def gemv2(x, w, *, block_n=64, block_k=128, steps=4, out_dtype=jnp.bfloat16):
    """y [M, N] = x @ w.T for x [M <= 8, D] bf16, w [N, D] bf16 (N a multiple of block_n): x read
    in 8-row TMA boxes (rows past M outside the array), y^T accumulated by wgmma with the weight
    tile as A, stored through a transposed view of an [8, block_n] shared-memory tile."""
    m, d = x.shape
    n, _ = w.shape

    def body(x_gmem, w_gmem, o_gmem):
        ni = lax.axis_index("n")

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, w_smem, x_smem: plgpu.wgmma(acc_ref, w_smem, x_smem.T),
                grid=(d // block_k,),
                in_specs=[
                    plgpu.BlockSpec((block_n, block_k), lambda k: (ni, k)),
                    plgpu.BlockSpec((8, block_k), lambda k: (0, k)),
                ],
                max_concurrent_steps=steps,
            )(w_gmem, x_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, 8)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((8, block_n), out_dtype))
        def _(o_smem):
            o_smem.T[...] = acc.astype(out_dtype)  # a value transpose has no lowering
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(0, m)], o_gmem.at[:, pl.ds(ni * block_n, block_n)]
            )
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(n, block_n),),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, w)
