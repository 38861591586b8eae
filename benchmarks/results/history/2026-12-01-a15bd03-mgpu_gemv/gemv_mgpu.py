import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

f32 = jnp.float32


def gemv_t(x8, w, *, block_n=64, block_k=256, steps=4, split=1):
    """y^T [split, N, R] fp32 partial sums of W[:, range] @ x8[:, range]^T.

    x8: [R, D] bf16 (R = 8: wgmma's smallest N); w: [N, D] bf16.
    """
    n, d = w.shape
    r = x8.shape[0]
    dk = d // split
    assert dk % block_k == 0

    def body(x_gmem, w_gmem, o_gmem):
        ni = lax.axis_index("n")
        si = lax.axis_index("s")

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, w_smem, x_smem: plgpu.wgmma(acc_ref, w_smem, x_smem.T),
                grid=(dk // block_k,),
                in_specs=[
                    plgpu.BlockSpec((block_n, block_k), lambda k: (ni, si * (dk // block_k) + k)),
                    plgpu.BlockSpec((r, block_k), lambda k: (0, si * (dk // block_k) + k)),
                ],
                max_concurrent_steps=steps,
            )(w_gmem, x_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, r)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_n, r), f32))
        def _(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(ni * block_n, block_n)])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((split, n, r), f32),
        grid=(pl.cdiv(n, block_n), split),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x8, w)
