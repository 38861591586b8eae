import os, sys, functools, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/benchmarks")
import jax, jax.numpy as jnp
import common
from bench_prefill import L2_EPS, _core_step, _lengths_from, core_inputs
from pallas_kernels.chunk_prepare import PrepareBlockSizes, _chunk_prepare
meta = common.meta(); records = common.Records(os.environ["OUT"] + "/quick.json")
b, t, h, kd = 1, 8192, 32, 128
inputs = core_inputs(b, t, h, kd, jax.random.key(7))
q, k, v, g, beta, a_log, dt_bias, h0 = inputs
g2 = g.reshape(b, t, h * kd)
for dw in (8, 4):
    blk = PrepareBlockSizes(diag_warps=dw)
    def step(state, blk=blk):
        inter = _chunk_prepare(q, k, v, g2, beta, _lengths_from(state, b, t), a_log, dt_bias, scale=kd**-0.5,
                               chunk=64, lower_bound=None, mm_dtype=jnp.bfloat16, l2_eps=L2_EPS, blk=blk)
        return state + inter.gl[:, :, :1, :1]
    t0 = time.time()
    common.run_case(records, meta, "chunk_prepare", f"B={b},T={t},H={h},gate=unbounded",
                    f"block_k=16,warps=4,diag_warps={dw}", functools.partial(common.time_loop, step, h0 + 0.0, 5, 2), 0.0, None, None)
    print("elapsed", round(time.time() - t0), flush=True)
run = functools.partial(common.time_loop, functools.partial(_core_step, inputs, None), h0 + 0.0, 5, 2)
common.run_case(records, meta, "chunk_kda", f"B={b},T={t},H={h},gate=unbounded", "default", run, 0.0, None, None)
