"""Stage times of the chunked prefill at H=32 (B=1, T=8192 by default), both gates, for tuning:
the whole core (chunk_kda) against FLA 0.6.0 chunk_kda in the same process, chunk_prepare,
chunk_scan and the block's conv_prefill (C = 3 x 4096 channels) alone over the block sizes
given, with --fla FLA's kernels one by one and with --kernels ours (torch.profiler: CUPTI lists
XLA's kernels too).

    python benchmarks/stage_profile.py --out PATH [--b B] [--t T] [--chunk C] [--fla] [--kernels]
                                       [--gates bounded,unbounded]
                                       [--configs default,num_stages=2+wu_stages=2 | none]
                                       [--scan-configs 32x4x2,64x4x2 | none]
                                       [--conv-configs 16x2x4,32x1x4 | none]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_prefill import (  # noqa: E402
    L2_EPS,
    LB,
    _core_step,
    _lengths_from,
    core_floor_us,
    core_inputs,
    fla_call,
    fla_us,
)
from decode_profile import profile_case  # noqa: E402

from kda_jax.config import DEFAULT_CHUNK  # noqa: E402
from pallas_kernels.chunk_prepare import PrepareBlockSizes, chunk_prepare  # noqa: E402
from pallas_kernels.chunk_scan import ScanBlockSizes, chunk_scan  # noqa: E402
from pallas_kernels.conv import ConvBlockSizes, conv_prefill  # noqa: E402


def prepare_block_sizes(config: str) -> PrepareBlockSizes:
    """`--configs` entry -> PrepareBlockSizes: "default", or fields changed from the default as
    "+"-joined name=value pairs, e.g. "num_stages=2+wu_stages=2" or "block_k=32"."""
    if config == "default":
        return PrepareBlockSizes()
    fields = {f.name for f in dataclasses.fields(PrepareBlockSizes)}
    changes = {}
    for pair in config.split("+"):
        name, _, value = pair.partition("=")
        if name not in fields or not value.isdigit():
            raise ValueError(
                f"stage_profile: bad --configs entry {pair!r}; expected name=int with name one "
                f"of {sorted(fields)}"
            )
        changes[name] = int(value)
    return dataclasses.replace(PrepareBlockSizes(), **changes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--b", type=int, default=1, help="batch rows B")
    parser.add_argument("--t", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="chunk width C of ours")
    parser.add_argument("--fla", action="store_true", help="also list FLA's kernels")
    parser.add_argument(
        "--kernels", action="store_true", help="also list the kernels of our chunk_kda step"
    )
    parser.add_argument(
        "--configs",
        type=lambda x: [] if x == "none" else x.split(","),
        default=["default"],
        help="chunk_prepare PrepareBlockSizes list: default, or name=value pairs joined by +, "
        "e.g. default,num_stages=2,wu_block_k=32+wu_stages=2; none: skip",
    )
    parser.add_argument(
        "--scan-configs",
        type=lambda x: (
            [] if x == "none" else [tuple(int(v) for v in c.split("x")) for c in x.split(",")]
        ),
        default=[(32, 4, 2)],
        help="chunk_scan block_v x num_warps x num_stages list, e.g. 32x4x2,64x4x2; none: skip",
    )
    parser.add_argument(
        "--conv-configs",
        type=lambda x: (
            [] if x == "none" else [tuple(int(v) for v in c.split("x")) for c in x.split(",")]
        ),
        default=[],
        help="conv_prefill block_t x block_heads x num_warps list, e.g. 16x2x4,32x1x4",
    )
    parser.add_argument(
        "--gates", default="bounded,unbounded", help="which gates to time, e.g. unbounded"
    )
    parser.add_argument(
        "--skip-core",
        action="store_true",
        help="time the chunk_prepare stage only: no chunk_kda timing and no FLA beside it",
    )
    args = parser.parse_args()
    unknown = set(args.gates.split(",")) - {"bounded", "unbounded"}
    if unknown:
        parser.error(f"--gates: unknown {sorted(unknown)}, expected bounded and/or unbounded")
    meta = common.meta()
    records = common.Records(args.out)
    b, t, h, kd = args.b, args.t, 32, 128
    inputs = core_inputs(b, t, h, kd, jax.random.key(7))
    q, k, v, g, beta, a_log, dt_bias, h0 = inputs
    g2 = g.reshape(b, t, h * kd)
    for lb, gate in ((LB, "bounded"), (None, "unbounded")):
        if gate not in args.gates.split(","):
            continue
        if args.fla:
            try:
                for row in common.torch_kernels(fla_call(inputs, lb)):  # us per call
                    print(f"FLA {gate}: {row}")
            except Exception as e:  # noqa: BLE001
                print(f"FLA unavailable: {type(e).__name__}: {e}")
        core_step = functools.partial(_core_step, inputs, lb, chunk=args.chunk)
        if args.kernels:
            prof = profile_case(core_step, h0 + 0.0, 5)
            print(f"ours {gate}: busy {prof['busy_us']} us, span {prof['span_us']} us per step")
            for r in prof["kernels"]:
                print(f"   {r['per_step']:6.2f} x {r['mean_us']:9.1f} us  {r['name']}")
        if not args.skip_core:
            try:
                fla = fla_us(inputs, lb, 5)
            except Exception as e:  # noqa: BLE001
                fla = None
                print(f"FLA unavailable: {type(e).__name__}: {e}")
            run = functools.partial(common.time_loop, core_step, h0 + 0.0, 10, 3)
            common.run_case(
                records,
                meta,
                "chunk_kda",
                f"B={b},T={t},H={h},gate={gate}",
                f"chunk={args.chunk}",
                run,
                core_floor_us(b, t, h, kd, args.chunk),
                fla,
                "fla chunk_kda",
            )
        kw = dict(
            scale=kd**-0.5, chunk=args.chunk, lower_bound=lb, mm_dtype=jnp.bfloat16, l2_eps=L2_EPS
        )
        shape = f"B={b},T={t},H={h},C={args.chunk},gate={gate}"
        for config in args.configs:
            blk = prepare_block_sizes(config)

            def prep_step(state, blk=blk, kw=kw):
                lengths = _lengths_from(state, b, t)
                inter = chunk_prepare(
                    q, k, v, g2, beta, lengths, a_log, dt_bias, **kw, block_sizes=blk
                )
                # One element of every output, so XLA keeps every kernel of the stage (taking gl
                # alone let it drop the w/u kernel as dead code: the records of 2026-12-01
                # before 7810162 time the first kernel only).
                return state + sum(x[:, :, :1, :1].astype(jnp.float32) for x in inter)

            run = functools.partial(common.time_loop, prep_step, h0 + 0.0, 10, 3)
            common.run_case(
                records,
                meta,
                "chunk_prepare",
                shape,
                config,
                run,
                0.0,
                None,
                None,
            )
    for bt, hb, warps in args.conv_configs:
        run = conv_run(b, t, ConvBlockSizes(block_heads=hb, block_t=bt, num_warps=warps))
        common.run_case(
            records,
            meta,
            "conv_prefill",
            f"B={b},T={t},C={3 * h * kd}",
            f"block_t={bt},heads={hb},warps={warps}",
            run,
            2 * b * t * 3 * h * kd * 2 / common.bandwidth() * 1e6,  # bf16 in and out
            None,
            None,
        )
    if not args.scan_configs:
        return
    inter = chunk_prepare(
        q,
        k,
        v,
        g2,
        beta,
        jnp.full((b,), t, jnp.int32),
        a_log,
        dt_bias,
        scale=kd**-0.5,
        chunk=args.chunk,
        lower_bound=LB,
        mm_dtype=jnp.bfloat16,
        l2_eps=L2_EPS,
        block_sizes=PrepareBlockSizes(),
    )
    for bv, warps, stages in args.scan_configs:
        blk = ScanBlockSizes(block_v=bv, num_warps=warps, num_stages=stages)
        step = lambda s, blk=blk: chunk_scan(  # noqa: E731
            inter, s, t=t, out_dtype=jnp.bfloat16, block_sizes=blk
        )[1]
        run = functools.partial(common.time_loop, step, h0 + 0.0, 10, 3)
        common.run_case(
            records,
            meta,
            "chunk_scan",
            f"B={b},T={t},H={h},C={args.chunk}",
            f"bv={bv},warps={warps},stages={stages}",
            run,
            0.0,
            None,
            None,
        )


def conv_run(b: int, t: int, blk: ConvBlockSizes, h: int = 32, kd: int = 128):
    """A timer of the block's conv_prefill (bf16 q|k|v in and out, split into q, k, v) at this
    tiling; the conv state chains the calls."""
    c = 3 * h * kd
    x = jax.random.normal(jax.random.key(1), (b, t, c), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (c, 4), jnp.float32)
    state = jax.random.normal(jax.random.key(3), (b, 3, c), jnp.float32)
    lengths = jnp.full((b,), t, jnp.int32)
    kw = dict(qk_channels=2 * h * kd, head_dim=kd, l2_eps=L2_EPS, out_dtype=jnp.bfloat16)

    def step(s):
        return conv_prefill(x, s, w, lengths, **kw, splits=(h * kd,) * 3, block_sizes=blk)[1]

    return functools.partial(common.time_loop, step, state, 10, 3)


if __name__ == "__main__":
    main()
