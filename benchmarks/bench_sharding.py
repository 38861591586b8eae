"""The sharded block (`kda_jax.sharding`) against the unsharded one, in the same process.

On one GPU, `--mesh 1x1` (the default) times what the shard_map wrapping and the per-shard
weight layout cost by themselves (no collective runs on a 'model' axis of 1); with more GPUs,
e.g. `--mesh 1x8`, the same cases time the head split with its one all-reduce per call. The
baseline of every case is `kda_jax.forward` on one device, same inputs, same backend.

Cases (kimi-linear-48b geometry, bf16 weights, pallas backend, unbounded gate):
- `prefill_sharded`: B=1 T=8192 and B=4 T=4096 (floor: the block's FLOPs at 790 TFLOP/s, as
  bench_prefill.py's `prefill_block`);
- `decode_sharded`: B=1, 8, 64 (floor: weights once + the state read and written, at
  `common.bandwidth()`).
Each is one jitted `fori_loop` of dependent calls (`common.time_loop`), median over reps.

Usage: python benchmarks/bench_sharding.py [--mesh DxM] [--quick] [--out PATH]
Records merge into benchmarks/results/prefill_sharded.json and decode_sharded.json; --out PATH
writes this run's records there instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_prefill import PEAK, block_flops, block_inputs  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax import sharding as S  # noqa: E402
from kda_jax.config import preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402

PREFILL_SHAPES = [(1, 8192), (4, 4096)]
DECODE_BATCHES = [1, 8, 64]


def _prefill_step(call):
    def step(carry):
        y, state = call(carry[0], carry[1])
        return y.astype(carry[0].dtype), state

    return step


def _fresh(tree):
    """A copy (time_loop donates its carry; placement on a 1x1 mesh may alias the buffers)."""
    return jax.tree.map(jnp.copy, tree)


def _interleaved(timer, one, many):
    """(baseline us, a call giving ours) timed one, many, one: the faster baseline of the two
    runs around ours (the first case timed in a process ran up to ~10% slower on the H100).
    `one` and `many` are (step, carry); each run gets a fresh carry: time_loop donates it."""
    first = timer(one[0], _fresh(one[1]))
    ours = timer(many[0], _fresh(many[1]))
    return min(first, timer(one[0], _fresh(one[1]))), lambda: ours


def bench(mesh_shape, quick, records, meta):
    cfg = preset("kimi-linear-48b")
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    mesh = jax.make_mesh(mesh_shape, ("data", "model"))
    sp = S.shard_params(params, cfg, mesh)
    label = f"pallas, mesh={mesh_shape[0]}x{mesh_shape[1]}"
    n, reps = (3, 3) if quick else (10, 5)
    for b, t in PREFILL_SHAPES:
        x, state = block_inputs(cfg, b, t, jax.random.key(b * t))
        one = _prefill_step(lambda x, s: forward.prefill(params, cfg, x, s, backend="pallas"))
        many = _prefill_step(lambda x, s: S.prefill(sp, cfg, x, s, backend="pallas"))
        ss = S.shard_state(_fresh(state), cfg, mesh)
        base, run = _interleaved(
            lambda step, carry: common.time_loop(step, carry, n, reps),
            (one, (x, state)),
            (many, (x, ss)),
        )
        common.run_case(
            records,
            meta,
            "prefill_sharded",
            f"B={b},T={t},D={cfg.hidden},H={cfg.heads},gate=unbounded",
            label,
            run,
            b * block_flops(cfg, t) / PEAK * 1e6,
            base,
            "kda_jax.forward.prefill (one device)",
            vs_baseline=lambda us, f=base: round(us / f, 3),
        )
    for b in DECODE_BATCHES:
        x, state = block_inputs(cfg, b, 1, jax.random.key(b))
        x = x[:, 0]
        one = _prefill_step(lambda x, s: forward.decode(params, cfg, x, s, backend="pallas"))
        many = _prefill_step(lambda x, s: S.decode(sp, cfg, x, s, backend="pallas"))
        ss = S.shard_state(_fresh(state), cfg, mesh)
        base, run = _interleaved(
            lambda step, carry: common.time_loop(step, carry, 4 * n, reps, differential=True),
            (one, (x, state)),
            (many, (x, ss)),
        )
        common.run_case(
            records,
            meta,
            "decode_sharded",
            f"B={b},D={cfg.hidden},H={cfg.heads}",
            label,
            run,
            (cfg.weight_bytes() + 2 * b * cfg.state_bytes()) / common.bandwidth() * 1e6,
            base,
            "kda_jax.forward.decode (one device)",
            vs_baseline=lambda us, f=base: round(us / f, 3),
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write this run's records here (default: merge into results)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument(
        "--mesh",
        default="1x1",
        type=lambda s: tuple(int(v) for v in s.split("x")),
        help="the ('data', 'model') mesh as DxM (default 1x1: one GPU)",
    )
    args = parser.parse_args()
    if len(args.mesh) != 2 or args.mesh[0] * args.mesh[1] > len(jax.devices()):
        parser.error(f"--mesh {args.mesh}: expected DxM with D*M <= {len(jax.devices())} devices")
    records = common.Records(args.out)
    bench(args.mesh, args.quick, records, common.meta())
    print(f"wrote {len(records)} records to {records.where()}")


if __name__ == "__main__":
    main()
