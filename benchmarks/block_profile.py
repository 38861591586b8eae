"""Kernel by kernel: one whole-block prefill of ours beside FLA 0.6.0's KimiDeltaAttention layer.

Both sides are profiled in one process with torch.profiler (CUPTI sees XLA's and Pallas's kernels
as well as PyTorch's): device µs per call of every kernel, busiest first, so a change to the block
shows where its time went. Ours: `forward.prefill`, pallas backend, bf16 weights, a loop of n
dependent calls. FLA: `layer(x)` under inference mode (SPEC §9).

    python benchmarks/block_profile.py [--b 1] [--t 8192] [--gates unbounded,bounded] [--out PATH]

Records (bench `prefill_block_profile`) merge into benchmarks/results/prefill_block_profile.json:
time_us is our busy device time per call, the baseline FLA's, each with its kernel list.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FLA shares the GPU

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_prefill import PEAK, block_flops, block_inputs  # noqa: E402
from decode_profile import profile_case  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax.config import preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402


def fla_profile(cfg, b: int, t: int) -> dict:
    import torch

    layer = common.fla_layer(cfg, cfg.gate_lower_bound)
    x = torch.randn(b, t, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    rows = common.torch_kernels(lambda: layer(x))
    return dict(
        busy_us=round(sum(us for _, us, _ in rows), 2),
        kernels=[dict(name=n, per_step=c, mean_us=round(us / c, 2)) for n, us, c in rows],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--b", type=int, default=1)
    parser.add_argument("--t", type=int, default=8192)
    parser.add_argument("--n", type=int, default=5, help="calls per profiled loop")
    parser.add_argument("--gates", default="unbounded,bounded")
    parser.add_argument("--out", help="write the records here instead of merging them")
    args = parser.parse_args()
    meta = common.meta()
    records = common.Records(args.out)
    for gate in args.gates.split(","):
        if gate not in ("unbounded", "bounded"):
            parser.error(f"--gates: expected unbounded and/or bounded, got {gate!r}")
        cfg = preset("kimi-linear-48b" + ("-bounded" if gate == "bounded" else ""))
        params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
        x, state = block_inputs(cfg, args.b, args.t, jax.random.key(1))

        def step(carry, cfg=cfg, params=params):
            y, st = forward.prefill(params, cfg, carry[0], carry[1], backend="pallas")
            return y.astype(carry[0].dtype), st

        ours = profile_case(step, (x, state), args.n)
        try:
            fla = fla_profile(cfg, args.b, args.t)
        except Exception as e:  # noqa: BLE001 - printed, baseline null
            print(f"[{gate}] FLA profile failed: {e!r}", file=sys.stderr)
            fla = None
        rec = dict(
            bench="prefill_block_profile",
            shape=f"B={args.b},T={args.t},D={cfg.hidden},H={cfg.heads},gate={gate}",
            backend="pallas",
            time_us=ours["busy_us"],
            floor_us=round(args.b * block_flops(cfg, args.t) / PEAK * 1e6, 2),
            baseline=None
            if fla is None
            else dict(name=common.FLA_LAYER_NAME, time_us=fla["busy_us"]),
            span_us=ours["span_us"],
            wall_us=ours["wall_us"],
            kernels=ours["kernels"],
            fla_kernels=None if fla is None else fla["kernels"],
        )
        rec.update(meta)
        records.append(rec)
        for side, ks in (("ours", ours["kernels"]), ("FLA", (fla or {}).get("kernels", []))):
            print(f"--- {side} ({gate}), device us per call")
            for k in ks[:25]:
                print(f"  {k['per_step'] * k['mean_us']:9.1f}  x{k['per_step']:<5} {k['name']}")
    print(f"wrote {len(records)} records to {records.where()}")


if __name__ == "__main__":
    main()
