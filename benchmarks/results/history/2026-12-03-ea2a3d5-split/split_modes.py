"""Session 21: which cross-CTA reduction of o_proj's split-D partial sums runs on the H200.
job26a's st.async form (`gemv_mgpu` at fccd190) hung. Modes, one subprocess each (a hang costs
its timeout only):
  store:      st.async of the partial y^T into the first CTA's shared memory (fccd190's form);
  store_sync: the same, then a cluster barrier before any CTA exits;
  load:       each CTA writes its partial to its own shared memory, a cluster barrier, the
              first CTA reads the others' through their cluster addresses, a second barrier.
    python benchmarks/wip/split_modes.py MODE SPLIT   (one case; prints a JSON line)
    python benchmarks/wip/split_modes.py --all OUT.json
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels import gemv_mgpu as MG  # noqa: E402

MR = MG.MAX_ROWS


def build(m, n, d, split, mode, bn=64, bk=128, steps=4):
    ks = d // bk // split
    bounds = (0, n)

    def body(x_gmem, w_gmem, o_gmem, red_smem, red_bar, cbar, own_smem):
        ni, si = lax.axis_index("n"), lax.axis_index("s")

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, w_smem, x_smem: plgpu.wgmma(acc_ref, w_smem, x_smem.T),
                grid=(ks,),
                in_specs=[
                    plgpu.BlockSpec((bn, bk), lambda k: (ni, si * ks + k)),
                    plgpu.BlockSpec((MR, bk), lambda k: (0, si * ks + k)),
                ],
                max_concurrent_steps=steps,
            )(w_gmem, x_gmem)
            return acc_ref[...]

        yt = pl.run_scoped(acc_scope, plgpu.ACC((bn, MR)))
        if mode.startswith("store"):

            @pl.when(si > 0)
            def _():
                plgpu.async_store_smem(
                    yt, red_smem.at[si - 1], red_bar, cluster_idx=0, cluster_dim="s"
                )

            @pl.when(si == 0)
            def _():
                plgpu.barrier_wait(red_bar)
                total = yt
                for j in range(split - 1):
                    total = total + red_smem[j]
                MG._store(total, (o_gmem,), ni=ni, m=m, bn=bn, bounds=bounds)

            if mode == "store_sync":
                plgpu.barrier_arrive(cbar.at[0])
                plgpu.barrier_wait(cbar.at[0])
        else:
            own_smem[...] = yt
            plgpu.barrier_arrive(cbar.at[0])
            plgpu.barrier_wait(cbar.at[0])

            @pl.when(si == 0)
            def _():
                total = yt
                for j in range(1, split):
                    total = total + plgpu.cluster_ref(own_smem, {"s": j})[...]
                MG._store(total, (o_gmem,), ni=ni, m=m, bn=bn, bounds=bounds)

            plgpu.barrier_arrive(cbar.at[1])
            plgpu.barrier_wait(cbar.at[1])

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        grid=(n // bn,),
        grid_names=("n",),
        cluster=(split,),
        cluster_names=("s",),
        scratch_types=(
            plgpu.SMEM((split - 1, bn, MR), jnp.float32),
            plgpu.Barrier(num_arrivals=128 * (split - 1)),
            plgpu.ClusterBarrier(collective_axes=("s",), num_barriers=2),
            plgpu.SMEM((bn, MR), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def one(mode, split):
    import numpy as np

    n, d = 2304, 4096
    rec = dict(mode=mode, split=split)
    kx, kw = jax.random.split(jax.random.key(0))
    w = (jax.random.normal(kw, (n, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    for m in (1, 8):
        x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
        f = jax.jit(build(m, n, d, split, mode))
        got = np.asarray(jax.block_until_ready(f(x, w)), np.float64)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        rec[f"m{m}_max_rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        again = np.asarray(f(x, w), np.float64)
        rec[f"m{m}_run_to_run_equal"] = bool(np.array_equal(got, again))
        for _ in range(3):
            jax.block_until_ready(f(x, w))
        t0 = time.perf_counter()
        for _ in range(200):
            y = f(x, w)
        jax.block_until_ready(y)
        rec[f"m{m}_us_per_call_host_loop"] = round((time.perf_counter() - t0) / 200 * 1e6, 2)
    print(json.dumps(rec), flush=True)


def main():
    if sys.argv[1] != "--all":
        one(sys.argv[1], int(sys.argv[2]))
        return
    recs = []
    for mode, split in (("store_sync", 4), ("load", 4), ("store", 4), ("store_sync", 2)):
        try:
            p = subprocess.run(
                [sys.executable, __file__, mode, str(split)],
                capture_output=True,
                text=True,
                timeout=45,
            )
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            rec = json.loads(lines[-1]) if lines else dict(mode=mode, split=split)
            if p.returncode:
                rec["error"] = p.stderr[-800:]
        except subprocess.TimeoutExpired:
            rec = dict(mode=mode, split=split, error="timed out after 45 s (hang)")
        print(json.dumps(rec), flush=True)
        recs.append(rec)
        with open(sys.argv[2], "w") as fh:
            json.dump(recs, fh, indent=1)


if __name__ == "__main__":
    main()
