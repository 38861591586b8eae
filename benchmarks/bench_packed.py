"""Packed variable-length prefill on one GPU: N prompts in one stream against FLA's chunk_kda
with the same `cu_seqlens`, and against our own core padded to the longest prompt.

Prompts: 16 and 64, lengths drawn uniformly in [64, 8192] and scaled (then clipped to that
range) to about 65536 tokens in all (`draw_lengths`, fixed seeds), H = 32, K = V = 128, bf16
inputs drawn as in bench_prefill.py (SPEC §9), fp32 initial states, both gates.

Cases:
- `prefill_packed_core`: our core (L2 of raw q, k fused, gate, beta, chunked recurrence, o in
  bf16, final states; no output norm) over the chunk-aligned stream that
  `forward.prefill_packed` lays the prompts out in (each prompt's tokens from a chunk start, at
  least W-1 rows before the next one; `forward.packed_rows` rows in all): `chunk_kda_packed`,
  one scan program per (prompt, head, V tile). The layout is built once at setup, as the block
  builds it from x before its projections (a gather of x, not of q, k, v). Baseline: FLA 0.6.0
  `chunk_kda` on the prompts back to back ([1, T, H, K]) with `cu_seqlens`, called as in SPEC §9
  (CUDA-graph replay of 20 calls, median), in this process; null with a printed reason when
  fla cannot import or refuses the call. Second figure (`padded_us`): our `chunk_kda` on the same
  prompts padded to the longest ([N, L_max, H, K] with lengths), what a caller without packing
  runs. Floor: bench_prefill's core floor for the T real tokens.
- `prefill_packed_block` (unless --core-only): `forward.prefill_packed` (pallas, bf16 weights,
  kimi-linear-48b geometry) over the same prompts, against `forward.prefill` of the prompts
  padded to the longest (the baseline, ours), with tokens/s.

JAX timing: one jitted `fori_loop` of n dependent calls (the states are the carry and set the
offsets, so nothing is loop-invariant), median over repetitions, divided by n.

Usage: python benchmarks/bench_packed.py [--quick] [--core-only] [--prompts 16,64]
                                         [--gates bounded,unbounded] [--out PATH]
The records are merged into benchmarks/results/prefill_packed_core.json and
prefill_packed_block.json (a newer record replaces the one of the same bench, shape and
backend); --out PATH writes this run's records to PATH instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FLA shares the GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_prefill  # noqa: E402
import common  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax.config import DEFAULT_CHUNK, preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402
from pallas_kernels.chunk import NEUTRAL_LOGIT, chunk_kda, chunk_kda_packed  # noqa: E402

FLA_NAME = "fla-0.6.0 chunk_kda (cu_seqlens)"
LB = bench_prefill.LB
L2_EPS = bench_prefill.L2_EPS
TOTAL, SHORTEST, LONGEST = 65536, 64, 8192
CONV = 4  # W of the Kimi-Linear geometry: the rows a prompt's conv state takes in the stream


def draw_lengths(n: int, seed: int, total=TOTAL, lo=SHORTEST, hi=LONGEST) -> np.ndarray:
    """n prompt lengths, uniform in [lo, hi], scaled to about `total` tokens and clipped to
    [lo, hi] (int64)."""
    raw = np.random.default_rng(seed).uniform(lo, hi, n)
    return np.clip(np.round(raw * total / raw.sum()), lo, hi).astype(np.int64)


def stream_layout(lengths, chunk: int, width: int = CONV):
    """The chunk-aligned stream of `forward.prefill_packed` for these lengths: (first stream row
    of each prompt [N], stream rows S, info [N, 4] for `chunk_scan`, no prefix states)."""
    lengths = np.asarray(lengths, np.int64)
    span = chunk * -(-(lengths + width - 1) // chunk)
    first = chunk + np.concatenate([[0], np.cumsum(span)[:-1]])
    cfg = preset("kimi-linear-48b").replace(chunk=chunk, conv_kernel=width)
    rows = forward.packed_rows(int(lengths.sum()), len(lengths), cfg)
    lo = first // chunk
    info = np.stack([lo, lo + -(-lengths // chunk), 0 * lo, 0 * lo], axis=1)
    return first, rows, info.astype(np.int32)


def packed_inputs(lengths, h: int, kd: int, chunk: int, key):
    """The prompts back to back (FLA's layout: q, k, v, g [1, T, H, K], beta [1, T, H], fp32
    A_log, dt_bias, initial states [N, H, K, V]), the same on our stream (f and b -inf on the rows
    no token holds, q, k, v 0 there) with its info, and cu_seqlens [N + 1]."""
    n, t = len(lengths), int(np.sum(lengths))
    q, k, v, g, beta, a_log, dt_bias, _ = bench_prefill.core_inputs(1, t, h, kd, key)
    h0 = 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (n, h, kd, kd), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    first, rows, info = stream_layout(lengths, chunk)
    dst = np.concatenate([first[i] + np.arange(lengths[i]) for i in range(n)])
    holds = np.zeros(rows, bool)
    holds[dst] = True

    def stream(a, fill):
        out = jnp.full((1, rows, *a.shape[2:]), fill, a.dtype)
        return out.at[:, jnp.asarray(dst)].set(a)

    streamed = (
        *(stream(a, 0.0) for a in (q, k, v)),
        stream(g.reshape(1, t, h * kd), NEUTRAL_LOGIT),
        stream(beta, NEUTRAL_LOGIT),
    )
    fla = (q, k, v, g, beta, a_log, dt_bias, h0)
    return fla, (*streamed, a_log, dt_bias, h0, jnp.asarray(info)), jnp.asarray(cu), holds


def pad_rows(a, cu):
    """a [1, T, ...] holding sequences back to back at offsets cu -> [N, L_max, ...], each
    sequence a row padded with zeros."""
    cu = np.asarray(cu)
    t = int(np.diff(cu).max())
    pad = [(0, 0)] * (a.ndim - 2)
    bounds = zip(cu[:-1], cu[1:], strict=True)
    return jnp.stack([jnp.pad(a[0, s:e], [(0, t - (e - s)), *pad]) for s, e in bounds])


def padded_inputs(fla, cu):
    """The prompts as rows of one batch padded to the longest, with their lengths."""
    q, k, v, g, beta, a_log, dt_bias, h0 = fla
    rows = (pad_rows(a, cu) for a in (q, k, v, g, beta))
    return (*rows, a_log, dt_bias, h0), jnp.asarray(np.diff(np.asarray(cu)), jnp.int32)


def _bump(state):
    """0, but computed from the carried state (keeps every call inside the loop)."""
    return (state[0, 0, 0, 0] > 1e30).astype(jnp.int32)


def packed_step(ours, state, lower_bound=None, chunk=DEFAULT_CHUNK):
    q, k, v, f, b, a_log, dt_bias, _, info = ours
    kd = q.shape[-1]
    _, new_state = chunk_kda_packed(
        q,
        k,
        v,
        f,
        b,
        state,
        info - _bump(state),
        a_log,
        dt_bias,
        scale=kd**-0.5,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=jnp.bfloat16,
        o_dtype=jnp.bfloat16,
        l2_eps=L2_EPS,
    )
    return new_state


def padded_step(inputs, state, lower_bound=None, chunk=DEFAULT_CHUNK):
    (q, k, v, g, beta, a_log, dt_bias, _), lengths = inputs
    b, t, h, kd = q.shape
    _, new_state = chunk_kda(
        q,
        k,
        v,
        g.reshape(b, t, h * kd),
        beta,
        state,
        lengths - _bump(state),
        a_log,
        dt_bias,
        scale=kd**-0.5,
        chunk=chunk,
        lower_bound=lower_bound,
        mm_dtype=jnp.bfloat16,
        o_dtype=jnp.bfloat16,
        l2_eps=L2_EPS,
    )
    return new_state


def fla_packed_call(fla, cu, lower_bound):
    """A no-argument call of FLA 0.6.0 chunk_kda over the prompts back to back with cu_seqlens
    (shared through DLPack); raises if fla is missing."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    q, k, v, g, beta, a_log, dt_bias, h0 = (torch.from_dlpack(x) for x in fla)
    cu_t = torch.from_dlpack(cu).long()
    extra = {} if lower_bound is None else dict(safe_gate=True, lower_bound=lower_bound)

    def call():
        return fla_chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=a_log,
            dt_bias=dt_bias,
            initial_state=h0,
            cu_seqlens=cu_t,
            **common.FLA_OPTIONS,
            **extra,
        )

    return call


def bench_core(prompts, gates, n, reps, records, meta, h=32, kd=128, chunk=DEFAULT_CHUNK):
    for count in prompts:
        lengths = draw_lengths(count, seed=count)
        t = int(lengths.sum())
        fla, ours, cu, _ = packed_inputs(lengths, h, kd, chunk, jax.random.key(count))
        fla, ours = jax.block_until_ready((fla, ours))
        shape = f"N={count},T={t},Lmax={int(lengths.max())},H={h},K={kd}"
        for lb, gate in ((LB, "bounded"), (None, "unbounded")):
            if gate not in gates:
                continue
            try:
                base = common.cuda_graph_us(fla_packed_call(fla, cu, lb), reps)
            except Exception as e:  # noqa: BLE001 - the reason is printed and baseline is null
                base = None
                why = f"{type(e).__name__}: {e}"
                print(
                    f"[prefill_packed_core {shape} {gate}] FLA unavailable: {why}", file=sys.stderr
                )
            padded_us = None
            try:
                padded, lens = padded_inputs(fla, cu)
                step = functools.partial(padded_step, lower_bound=lb, chunk=chunk)
                h0 = fla[-1] + 0.0
                padded_us = round(common.time_loop(step, h0, n, reps, consts=(padded, lens)), 2)
                del padded
            except Exception as e:  # noqa: BLE001 - printed, the figure is null
                why = f"{e!r}"[:400]
                print(f"[prefill_packed_core {shape} {gate}] padded failed: {why}", file=sys.stderr)
            step = functools.partial(packed_step, lower_bound=lb, chunk=chunk)
            run = functools.partial(common.time_loop, step, fla[-1] + 0.0, n, reps, consts=ours)
            common.run_case(
                records,
                meta,
                "prefill_packed_core",
                f"{shape},gate={gate}",
                f"pallas(C={chunk}, chunk-aligned stream, o bf16, no o_norm)",
                run,
                bench_prefill.core_floor_us(1, t, h, kd, chunk),
                base,
                FLA_NAME,
                vs_baseline=lambda us, f=base: None if f is None else round(us / f, 3),
                padded_us=padded_us,
                vs_padded=lambda us, p=padded_us: None if p is None else round(us / p, 3),
                lengths=[int(v) for v in lengths],
            )
        del fla, ours


def bench_block(prompts, gates, n, reps, records, meta):
    """forward.prefill_packed against forward.prefill of the same prompts padded to the longest
    (pallas, bf16 weights, Kimi-Linear geometry)."""
    for gate in gates:
        cfg = preset("kimi-linear-48b" + ("-bounded" if gate == "bounded" else ""))
        params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
        for count in prompts:
            lengths = draw_lengths(count, seed=count)
            t = int(lengths.sum())
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
            x, state = bench_prefill.block_inputs(cfg, 1, t, jax.random.key(count))
            x = x[0]
            state = jax.tree.map(lambda a, c=count: jnp.repeat(a, c, axis=0), state)
            padded_us = None
            try:
                xp, lens = pad_rows(x[None], cu), jnp.asarray(lengths, jnp.int32)

                def padded(carry, cfg=cfg, params=params, lens=lens):
                    n_ = lens - _bump(carry[1].recurrent)
                    y, st = forward.prefill(params, cfg, carry[0], carry[1], n_, backend="pallas")
                    return y.astype(carry[0].dtype), st

                padded_us = round(common.time_loop(padded, (xp, state), n, reps), 2)
                del xp
            except Exception as e:  # noqa: BLE001 - printed, baseline null
                print(f"[prefill_packed_block N={count} {gate}] padded run failed: {e!r}"[:400],
                      file=sys.stderr)  # fmt: skip

            def step(carry, cfg=cfg, params=params, cu=cu):
                offsets = cu - _bump(carry[1].recurrent)
                y, st = forward.prefill_packed(
                    params, cfg, carry[0], offsets, carry[1], backend="pallas"
                )
                return y.astype(carry[0].dtype), st

            run = functools.partial(common.time_loop, step, (x, state), n, reps)
            floor = bench_prefill.block_flops(cfg, t) / bench_prefill.PEAK * 1e6
            common.run_case(
                records,
                meta,
                "prefill_packed_block",
                f"N={count},T={t},Lmax={int(lengths.max())},D={cfg.hidden},H={cfg.heads},"
                f"gate={gate}",
                "pallas",
                run,
                floor,
                padded_us,
                "kda-jax prefill padded to the longest (pallas)",
                vs_baseline=lambda us, f=padded_us: None if f is None else round(us / f, 3),
                tokens_per_s=lambda us, t=t: round(t / us * 1e6),
            )
            del x, state


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", help="write this run's records here (default: merge into benchmarks/results/)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--core-only", action="store_true", help="skip the whole-block cases")
    parser.add_argument(
        "--prompts",
        type=lambda s: tuple(int(v) for v in s.split(",")),
        default=(16, 64),
        help="prompt counts, e.g. 16,64",
    )
    parser.add_argument("--gates", default="bounded,unbounded", help="gates, e.g. bounded")
    args = parser.parse_args()
    gates = args.gates.split(",")
    if not set(gates) <= {"bounded", "unbounded"}:
        parser.error(f"--gates: expected bounded and/or unbounded, got {args.gates!r}")
    meta = common.meta()
    reps = 3 if args.quick else 5
    records = common.Records(args.out)
    bench_core(args.prompts, gates, 10 if args.quick else 20, reps, records, meta)
    if not args.core_only:
        bench_block(args.prompts, gates, 3 if args.quick else 5, reps, records, meta)
    for r in records:
        t, base = r["time_us"], r["baseline"]
        base_s = "-" if base is None else f"{base['name']}: {base['time_us']} us"
        if r.get("padded_us") is not None:
            base_s += f"; ours padded {r['padded_us']} us"
        t_s = "FAILED" if t is None else f"{t:.1f}"
        print(f"{r['bench']:<22}{r['shape']:<58}{t_s:>9}  {base_s}")
    print(f"wrote {len(records)} records to {records.where()}")


if __name__ == "__main__":
    main()
