"""Session 19 experiment: the weight tile as wgmma's A operand, x as a 16-column B, and the
[block_n, 16] accumulator transposed by a second wgmma against a [64, 16] identity (exact for a
bf16 output: bf16(acc) * 1 summed in fp32). y is stored as [M, N] by TMA."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

f32, bf16 = jnp.float32, jnp.bfloat16
R = 16


def gemv_wt(x, w, *, block_n=64, block_k=128, steps=4):
    """bf16 y [M, N]: the weight tile as wgmma's A ([block_n, bk]), x as a 16-column B; the
    [block_n, 16] accumulator is transposed by a second wgmma against a [64, 16] identity."""
    m, d = x.shape
    n, _ = w.shape

    def body(x_gmem, w_gmem, o_gmem):
        ni = lax.axis_index("n")

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, w_smem, x_smem: plgpu.wgmma(acc_ref, w_smem, x_smem.T),
                grid=(pl.cdiv(d, block_k),),
                in_specs=[
                    plgpu.BlockSpec((block_n, block_k), lambda k: (ni, k)),
                    plgpu.BlockSpec((R, block_k), lambda k: (0, k)),
                ],
                max_concurrent_steps=steps,
            )(w_gmem, x_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, R)))

        @functools.partial(
            pl.run_scoped,
            t_smem=plgpu.SMEM((block_n, R), bf16),
            e_smem=plgpu.SMEM((64, R), bf16),
            o_smem=plgpu.SMEM((64, block_n), bf16),
        )
        def _(t_smem, e_smem, o_smem):
            t_smem[...] = acc.astype(bf16)
            eye = lax.broadcasted_iota(jnp.int32, (64, R), 0) == lax.broadcasted_iota(
                jnp.int32, (64, R), 1
            )
            e_smem[...] = eye.astype(bf16)
            plgpu.commit_smem()

            def tr(acc2):
                plgpu.wgmma(acc2, e_smem, t_smem.T)
                return acc2[...]

            yt = pl.run_scoped(tr, plgpu.ACC((64, block_n)))
            o_smem[...] = yt.astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(0, m)], o_gmem.at[:, pl.ds(ni * block_n, block_n)]
            )
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), bf16),
        grid=(pl.cdiv(n, block_n),),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, w)
