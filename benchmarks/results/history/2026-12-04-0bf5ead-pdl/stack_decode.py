"""Decode per block inside a stack of L blocks (distinct weights and states), as a model's decode
loop runs it, against bench_decode's one-block loop, in one process.

One block in a `fori_loop` pays the loop's counter add (a launch, ~1 us at B = 1) every step and
may find part of its 77 MB of weights still in the 50 MB L2 from the step before; L distinct
blocks per trip share the add and leave nothing in L2 for the next. Per case it prints and
records the wall time per block per step, taken differentially as bench_decode.py does.

    python benchmarks/wip/stack_decode.py --out PATH [--layers 1,4] [--batches 1,64]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, root)
sys.path.insert(0, os.path.join(root, "benchmarks"))

import common  # noqa: E402
from bench_decode import BANDWIDTH, random_state  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax.config import preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402


def stack_step(all_params, cfg):
    def step(carry):
        x, states = carry
        new = []
        for params, state in zip(all_params, states, strict=True):
            y, state = forward.decode(params, cfg, x, state, backend="pallas")
            x = y.astype(x.dtype)
            new.append(state)
        return x, tuple(new)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", default="1,4")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cfg = preset("kimi-linear-48b")
    layers = [int(v) for v in args.layers.split(",")]
    all_params = [init_params(cfg, jax.random.key(i), jnp.bfloat16) for i in range(max(layers))]
    meta = common.meta()
    meta["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    records = common.Records(args.out)
    for b in (int(v) for v in args.batches.split(",")):
        floor = (cfg.weight_bytes() + 2 * b * cfg.state_bytes()) / BANDWIDTH * 1e6
        for n_layers in layers:
            key = jax.random.key(b)
            x = jax.random.normal(key, (b, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
            states = tuple(
                random_state(cfg, b, jax.random.fold_in(key, i)) for i in range(n_layers)
            )
            run = functools.partial(
                common.time_loop,
                stack_step(all_params[:n_layers], cfg),
                (x, states),
                args.n,
                args.reps,
                differential=True,
            )

            def per_block(run=run, n_layers=n_layers):
                return run() / n_layers

            shape = f"B={b},D={cfg.hidden},H={cfg.heads},K={cfg.head_dim},layers={n_layers}"
            t = common.run_case(
                records, meta, "decode_stack", shape, "pallas", per_block, floor, None, ""
            )
            if t:
                print(f"B={b} layers={n_layers}: {t:.2f} us per block ({t / floor:.2f}x floor)")


if __name__ == "__main__":
    main()
