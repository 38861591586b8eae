"""Prefill timings on one GPU: the chunked core against FLA's chunk_kda, and the whole block.

Work per chunk of C tokens and one head (K = V = 128; the figures are at C = 64), counting
triangular products at half (C(C+1)/2 ~ C^2/2 entries) and a multiply-add as 2 FLOPs:
  chunk_prepare: A = q k^T and L = k k^T (C^2 K each), w = T kb (C^2 K), u = T vb (C^2 V),
                 T by sub-blocks (~C^3/3)                            -> C^2 (3K + V) + C^3/3
  chunk_scan:    w S, qg S, kg^T Delta (2 C K V each), A Delta (C^2 V, triangular)
                 (+ the Delta lo part, 2 C K V + C^2 V, not counted)  -> 6 C K V + C^2 V
  total ~ C^2 (3K + 2V) + C^3/3 + 6 C K V = 2.6 + 0.09 + 6.3 = 9.0 MFLOP per (chunk, head);
  B=1, T=8192, H=32: 4096 (chunk, head) pairs -> 37 GFLOP -> 47 us at 790 TFLOP/s.
Bytes (bf16 activations): the least any implementation moves is q, k, v, f (4 x T H K x 2 B),
beta (T H x 2 B), o (T H V x 2 B) and the fp32 state in and out: ~ 10.3 KB per token at H=32,
B=1, T=8192: 340 MB -> 79 us at 4.3 TB/s. This two-kernel design also writes and reads back the
intermediates (qg, kg, w, A in bf16, u fp32, exp(G_last)): 2 x 88 KB per (chunk, head), ~ 720 MB
more at T=8192 (the scan re-reads per V tile hit L2). Core floor = max(FLOP floor, byte floor).

Whole block (`kda_jax.forward.prefill`, preset kimi-linear-48b, bf16 weights): FLOP floor =
projections 2 T (D (3P + 2K + H) + 2 P K + P D) + the chunk FLOPs above, at 790 TFLOP/s.

Cases:
- `prefill_core`: L2 of raw q, k (fused into chunk_prepare, like FLA's use_qk_l2norm_in_kernel)
  + gate + beta + chunked recurrence, output o in bf16 and the fp32 final state; no output norm
  (FLA has none). B=1 T=8192, B=4 T=4096, B=1 T=32768 at H=32, both gates. Baseline: FLA 0.6.0
  `chunk_kda` on the same input arrays (shared through DLPack), called as in SPEC §9, CUDA-graph
  replay of 20 calls, median; null with a printed reason when fla cannot import.
- `prefill_block`: `forward.prefill` (pallas, bf16 weights, kimi-linear-48b geometry) at
  B=1 T=8192, B=4 T=4096, B=1 T=32768, B=16 T=1024, both gates, with tokens/s. Baseline: FLA
  0.6.0's own layer `fla.layers.kda.KimiDeltaAttention` on the same geometry and gate in the same
  process (SPEC §9), eager and replayed as a CUDA graph; the faster of the two is the baseline
  and both are recorded.
Stage times and block-size sweeps of chunk_prepare / chunk_scan: benchmarks/stage_profile.py.

JAX timing: one jitted `fori_loop` of n dependent calls (the final state is the carry and sets
`lengths`, so nothing is loop-invariant), median over repetitions, divided by n.

Usage: python benchmarks/bench_prefill.py [--quick] [--core-only | --block-only] [--out PATH]
                                          [--chunks 64,32] [--gates bounded,unbounded]
                                          [--shapes 1x8192,4x4096]
The records are merged into benchmarks/results/prefill_core.json and prefill_block.json (a
newer record replaces the one of the same bench, shape and backend); --out PATH writes this
run's records to PATH instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FLA shares the GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax.config import DEFAULT_CHUNK, preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402
from kda_jax.state import KdaState  # noqa: E402
from pallas_kernels.chunk import chunk_kda  # noqa: E402

PEAK = 790e12  # FLOP/s, bf16 matmul (PALLAS.md)
FLA_NAME = "fla-0.6.0 chunk_kda"
LB = -5.0
L2_EPS = 1e-6
BLOCK_SHAPES = [(1, 8192), (4, 4096), (1, 32768), (16, 1024)]


def chunk_flops(b, t, h, kd, vd, c=64):
    n = -(-t // c)
    per = c * c * (3 * kd + 2 * vd) + c**3 / 3 + 6 * c * kd * vd
    return b * n * h * per


def core_bytes(b, t, h, kd, vd):
    return b * t * h * (3 * kd * 2 + kd * 2 + 2 + vd * 2) + 2 * b * h * kd * vd * 4


def core_floor_us(b, t, h, kd, c):
    """The core's floor at chunk width c: max(FLOP floor, byte floor), in us."""
    return 1e6 * max(
        chunk_flops(b, t, h, kd, kd, c) / PEAK, core_bytes(b, t, h, kd, kd) / common.bandwidth()
    )


# ----------------------------------------------------------------------------------------------
# Core: ours vs FLA chunk_kda on the same arrays
# ----------------------------------------------------------------------------------------------
def core_inputs(b, t, h, kd, key):
    """FLA's input set (SPEC §9): bf16 normal q, k, v, raw gate g [B,T,H,K], beta logits, fp32
    A_log [H], dt_bias [H*K], fp32 initial state."""
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    rnd = lambda i, *s: jax.random.normal(ks[i], s, jnp.float32).astype(bf)  # noqa: E731
    q, k, v, g = (rnd(i, b, t, h, kd) for i in range(4))
    beta = rnd(4, b, t, h)
    a_log = jnp.log(jax.random.uniform(ks[5], (h,), jnp.float32, 1.0, 16.0))
    dt_bias = 0.1 * jax.random.normal(ks[6], (h * kd,), jnp.float32)
    h0 = 0.1 * jax.random.normal(ks[7], (b, h, kd, kd), jnp.float32)
    return q, k, v, g, beta, a_log, dt_bias, h0


def fla_call(inputs, lower_bound):
    """A no-argument call of FLA 0.6.0 chunk_kda on `inputs` (shared through DLPack), as SPEC §9
    took its figures; raises if fla is missing."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    q, k, v, g, beta, a_log, dt_bias, h0 = (torch.from_dlpack(x) for x in inputs)
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
            **common.FLA_OPTIONS,
            **extra,
        )

    return call


def fla_us(inputs, lower_bound, reps):
    """Median us per FLA chunk_kda call (CUDA-graph replay)."""
    return common.cuda_graph_us(fla_call(inputs, lower_bound), reps)


def _lengths_from(state, b, t):
    """Full lengths that depend on the carried state (keeps every call inside the loop)."""
    bump = (state[0, 0, 0, 0] > 1e30).astype(jnp.int32)
    return jnp.full((b,), t, jnp.int32) - bump


def _core_step(inputs, lower_bound, state, chunk=DEFAULT_CHUNK):
    q, k, v, g, beta, a_log, dt_bias, _ = inputs
    b, t, h, kd = q.shape
    _, new_state = chunk_kda(
        q,
        k,
        v,
        g.reshape(b, t, h * kd),
        beta,
        state,
        _lengths_from(state, b, t),
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


def bench_core(shapes, n, reps, records, meta, h=32, kd=128, chunks=(DEFAULT_CHUNK,), gates=None):
    """Our core at each chunk width in `chunks` beside FLA's (timed once per shape and gate),
    C named in the backend label. `gates`: None for both, else a subset of
    ("bounded", "unbounded")."""
    for b, t in shapes:
        inputs = jax.block_until_ready(core_inputs(b, t, h, kd, jax.random.key(t + b)))
        for lb, gate in ((LB, "bounded"), (None, "unbounded")):
            if gates is not None and gate not in gates:
                continue
            try:
                fla = fla_us(inputs, lb, reps)
            except Exception as e:  # noqa: BLE001 - the reason is printed and baseline is null
                fla = None
                print(
                    f"[prefill_core B={b} T={t} {gate}] FLA baseline unavailable: "
                    f"{type(e).__name__}: {e}",
                    file=sys.stderr,
                )
            for c in chunks:
                step = functools.partial(_core_step, inputs, lb, chunk=c)
                run = functools.partial(common.time_loop, step, inputs[-1] + 0.0, n, reps)
                common.run_case(
                    records,
                    meta,
                    "prefill_core",
                    f"B={b},T={t},H={h},K={kd},gate={gate}",
                    f"pallas(C={c}, o bf16, no o_norm)",
                    run,
                    core_floor_us(b, t, h, kd, c),
                    fla,
                    FLA_NAME,
                    vs_baseline=lambda us, f=fla: None if f is None else round(us / f, 3),
                )
        del inputs


# ----------------------------------------------------------------------------------------------
# Whole block
# ----------------------------------------------------------------------------------------------
def block_flops(cfg, t):
    p, kd, d, h = cfg.qkv_dim, cfg.head_dim, cfg.hidden, cfg.heads
    proj = 2 * t * (d * cfg.in_proj_dim + 2 * p * kd + p * d)
    return proj + chunk_flops(1, t, h, kd, kd, cfg.chunk)


def block_inputs(cfg, b, t, key):
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (b, t, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
    state = KdaState(
        recurrent=0.1 * jax.random.normal(k2, cfg.recurrent_state_shape(b), jnp.float32),
        conv=jax.random.normal(k3, cfg.conv_state_shape(b), jnp.float32),
    )
    return x, state


def block_case(gate: str, bench: str):
    """(cfg, bf16 params, FLA's layer or None) of the kimi-linear-48b block with this gate; why
    FLA's layer is missing is printed."""
    cfg = preset("kimi-linear-48b" + ("-bounded" if gate == "bounded" else ""))
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    try:
        layer = common.fla_layer(cfg, cfg.gate_lower_bound)
    except Exception as e:  # noqa: BLE001 - the reason is printed and baseline is null
        layer = None
        print(f"[{bench} {gate}] FLA layer unavailable: {e!r}", file=sys.stderr)
    return cfg, params, layer


def bench_block(shapes, gates, n, reps, records, meta):
    """The whole block (`forward.prefill`, pallas, bf16 weights) against FLA's own layer on the
    same geometry and gate in this process, eager and as a CUDA graph; the faster is the
    baseline."""
    for gate in gates:
        cfg, params, layer = block_case(gate, "prefill_block")
        for b, t in shapes:
            fla = None
            if layer is not None:
                try:
                    fla = common.fla_layer_prefill_us(layer, b, t, reps=7)
                except Exception as e:  # noqa: BLE001 - printed, baseline null
                    print(f"[prefill_block B={b} T={t} {gate}] FLA failed: {e!r}", file=sys.stderr)
            x, state = block_inputs(cfg, b, t, jax.random.key(b * t))

            def step(carry, cfg=cfg, params=params):
                y, st = forward.prefill(params, cfg, carry[0], carry[1], backend="pallas")
                return y.astype(carry[0].dtype), st

            run = functools.partial(common.time_loop, step, (x, state), n, reps)
            floor = b * block_flops(cfg, t) / PEAK * 1e6
            base = None if fla is None else min(fla.values())
            kind = None if fla is None else min(fla, key=fla.get)
            common.run_case(
                records,
                meta,
                "prefill_block",
                f"B={b},T={t},D={cfg.hidden},H={cfg.heads},gate={gate}",
                "pallas",
                run,
                floor,
                base,
                f"{common.FLA_LAYER_NAME} ({'CUDA graph' if kind == 'graph' else 'eager'})",
                vs_baseline=lambda us, f=base: None if f is None else round(us / f, 3),
                tokens_per_s=lambda us, bt=b * t: round(bt / us * 1e6),
                floor_tokens_per_s=round(b * t / floor * 1e6),
                fla_eager_us=None if fla is None else fla["eager"],
                fla_graph_us=None if fla is None else fla["graph"],
            )
            del x, state


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", help="write this run's records here (default: merge into benchmarks/results/)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--core-only", action="store_true", help="skip the whole-block cases")
    only.add_argument("--block-only", action="store_true", help="skip the core cases (and FLA)")
    parser.add_argument(
        "--chunks",
        type=lambda x: tuple(int(c) for c in x.split(",")),
        default=(DEFAULT_CHUNK,),
        help="chunk widths of our core, e.g. 64,32 (default: the config's default, "
        f"{DEFAULT_CHUNK}; FLA runs once per shape and gate)",
    )
    parser.add_argument("--gates", default="bounded,unbounded", help="gates, e.g. bounded")
    parser.add_argument(
        "--shapes",
        type=lambda x: [tuple(int(v) for v in s.split("x")) for s in x.split(",")],
        default=[(1, 8192), (4, 4096), (1, 32768)],
        help="core shapes as BxT, e.g. 1x32768",
    )
    args = parser.parse_args()
    meta = common.meta()
    reps = 3 if args.quick else 5
    records = common.Records(args.out)
    if not args.block_only:
        gates = set(args.gates.split(","))
        if not gates <= {"bounded", "unbounded"}:
            parser.error(f"--gates: expected bounded and/or unbounded, got {args.gates!r}")
        bench_core(args.shapes, 20, reps, records, meta, chunks=args.chunks, gates=gates)
    if not args.core_only:
        gates = [g for g in ("unbounded", "bounded") if g in args.gates.split(",")]
        bench_block(BLOCK_SHAPES, gates, 5 if args.quick else 10, reps, records, meta)
    print(f"\n{'bench':<14}{'shape':<44}{'backend':<44}{'time_us':>9}{'floor_us':>9}  baseline")
    for r in records:
        t = r["time_us"]
        base = r["baseline"]
        base_s = "-" if base is None else f"{base['name']}: {base['time_us']} us"
        if base is not None and t is not None:
            base_s += f" (ours/base {t / base['time_us']:.2f}x)"
        if "tokens_per_s" in r:
            base_s += f"  [{r['tokens_per_s']:.3g} tok/s, floor {r['floor_tokens_per_s']:.3g}]"
        t_s = "FAILED" if t is None else f"{t:.1f}"
        print(
            f"{r['bench']:<14}{r['shape']:<44}{r['backend']:<44}{t_s:>9}"
            f"{r['floor_us']:>9.1f}  {base_s}"
        )
    print(f"wrote {len(records)} records to {records.where()}")


if __name__ == "__main__":
    main()
