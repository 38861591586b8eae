"""Decode-path timings on one GPU: the whole block, the verify, and the decode core against FLA.

Kimi-Linear geometry (`preset("kimi-linear-48b")`), bf16 weights from `init_params`, random
non-zero states. Every JAX figure is per step of a jitted `fori_loop` of dependent steps (the
state, donated, is the loop carry; the block's output feeds the next step's input so nothing is
loop-invariant), taken differentially: (T(3n) - T(n)) / 2n over the medians of repeated calls,
so the fixed cost of each call (dispatch, donation, sync: 0.2-0.4 ms) is not spread over the
steps (`common.time_loop`); FLA's per-call figure is a CUDA-graph replay, which has no such cost.

Cases:
- `decode`: `kda_jax.forward.decode` at B = 1, 8, 64, backends pallas and xla. Floor: the
  weights read once plus the state read and written, at the device's copy bandwidth
  (`common.bandwidth`: 4.3 TB/s on the H200, 3.0 on the H100). Baseline: xla at the same B.
- `decode_k`: k = 2, 4, 8 at B = 1 (pallas). Floor: weights once, the state read once and
  written k times (the snapshots). Baseline: one pallas `decode` step.
- `conv_decode`: the conv + SiLU + L2 stage alone at B = 1, 64 (pallas and xla), so the whole
  step can be split into its stages (the projections: bench_gemv.py; the core: below).
- `decode_core`: L2 of raw q, k + gate + beta + recurrence + read-out, FLA's work (no RMSNorm:
  `recurrent.fused_recurrent`; the loop carries the state and the read-out o, so neither can be
  dropped as unused), on bf16 inputs at B = 1, 8, 64, H = 32, K = V = 128, at the recurrent
  kernel's default V tile (`--tiles`: the other V tiles too), and for the xla reference.
  Floor: the state read and written, q, k, v, f, beta read and o written in bf16 (FLA's
  traffic; ours writes o in fp32). Baseline: FLA 0.6.0 `fused_recurrent_kda` called as in
  SPEC §9 (CUDA-graph replay of 20 calls, median), in this process; null with a printed reason
  when fla cannot import. (fla 0.6.0's public wrapper swallows `inplace_final_state=True` in
  **kwargs and allocates the final state, as when the reference figures were taken.)

- `decode_pool` (`--pool` runs these cases alone): `decode` at B = 1, 8, 64, 256, 1024 from a
  state pool of 2B slots, the B rows at shuffled slots (`slots=`, the pool donated as the loop
  carry), pallas. Floor: the weights plus the B named states read and written. Baseline: FLA
  0.6.0's layer `KimiDeltaAttention` decode step (SPEC §10: a cache primed with 16 tokens, then
  `layer(x[B, 1, D], past_key_values=cache, use_cache=True)`), eager and as a CUDA graph; the
  faster is the baseline, both are recorded.
- `decode_k_pool` (with `--pool`): k = 4 at B = 64 from a pool of 128. Floor: weights once, the
  states read once and the snapshots written k times. Baseline: one `decode_pool` step at B=64.

Each record: bench, shape, backend, time_us (null + error when the case failed), floor_us,
fraction (= floor_us / time_us), baseline ({name, time_us} or null), date, commit, device, command.

Usage: python benchmarks/bench_decode.py [--quick] [--tiles] [--pool] [--out PATH]
The records are merged into benchmarks/results/<bench>.json (a newer record replaces the one of
the same bench, shape and backend); --out PATH writes this run's records to PATH instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FLA shares the GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax.config import preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402
from kda_jax.state import KdaState  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402
from pallas_kernels.recurrent import RecurrentBlockSizes, fused_recurrent  # noqa: E402

FLA_NAME = "fla 0.6.0 fused_recurrent_kda"


def random_state(cfg, batch, key):
    k1, k2 = jax.random.split(key)
    return KdaState(
        recurrent=0.1 * jax.random.normal(k1, cfg.recurrent_state_shape(batch), jnp.float32),
        conv=jax.random.normal(k2, cfg.conv_state_shape(batch), jnp.float32),
    )


def _decode_step(params, cfg, backend):
    def step(carry):
        y, state = forward.decode(params, cfg, carry[0], carry[1], backend=backend)
        return y.astype(carry[0].dtype), state

    return step


def _decode_k_step(params, cfg):
    def step(carry):
        y, state, _ = forward.decode_k(params, cfg, carry[0], carry[1], backend="pallas")
        return y.astype(carry[0].dtype), state

    return step


def bench_block(cfg, params, batches, n, reps, records, meta):
    """Whole-block decode, both backends, and decode_k at B = 1."""
    times = {}
    for backend in ("xla", "pallas"):
        for b in batches:
            key = jax.random.key(b)
            x = jax.random.normal(key, (b, cfg.hidden), jnp.float32).astype(params.dtype)
            run = functools.partial(
                common.time_loop,
                _decode_step(params, cfg, backend),
                (x, random_state(cfg, b, key)),
                n,
                reps,
                differential=True,
            )
            floor = (cfg.weight_bytes() + 2 * b * cfg.state_bytes()) / common.bandwidth() * 1e6
            shape = f"B={b},D={cfg.hidden},H={cfg.heads},K={cfg.head_dim}"
            base = None if backend == "xla" else times.get(("xla", b))
            times[backend, b] = common.run_case(
                records, meta, "decode", shape, backend, run, floor, base, "xla decode"
            )
    b = 1
    serial = times.get(("pallas", b))
    for k in (2, 4, 8):
        key = jax.random.key(100 + k)
        x = jax.random.normal(key, (b, k, cfg.hidden), jnp.float32).astype(params.dtype)
        run = functools.partial(
            common.time_loop,
            _decode_k_step(params, cfg),
            (x, random_state(cfg, b, key)),
            n,
            reps,
            differential=True,
        )
        # The state is read once and written k times (the snapshots).
        floor = (cfg.weight_bytes() + (1 + k) * b * cfg.state_bytes()) / common.bandwidth() * 1e6
        shape = f"B={b},k={k},D={cfg.hidden},H={cfg.heads}"
        common.run_case(
            records,
            meta,
            "decode_k",
            shape,
            "pallas",
            run,
            floor,
            serial,
            "pallas decode (one token)",
        )


POOL_BATCHES = (1, 8, 64, 256, 1024)


def pool_case(cfg, params, b: int, key, k: int = 0, backend: str = "pallas"):
    """One pool case: (step, carry, floor_us) for `decode` (k = 0) or `decode_k` at B rows from
    a pool of 2B random states, the rows at shuffled distinct slots. The carry is (x, pool): the
    pool is the loop's donated carry; the output feeds the next step's input."""
    kx, ks, kp = jax.random.split(key, 3)
    pool = random_state(cfg, 2 * b, ks)
    slots = jax.random.permutation(kp, 2 * b)[:b].astype(jnp.int32)
    shape = (b, cfg.hidden) if k == 0 else (b, k, cfg.hidden)
    x = jax.random.normal(kx, shape, jnp.float32).astype(params.dtype)

    def step(carry):
        if k == 0:
            y, new = forward.decode(params, cfg, carry[0], carry[1], slots=slots, backend=backend)
        else:
            y, new, _ = forward.decode_k(
                params, cfg, carry[0], carry[1], slots=slots, backend=backend
            )
        return y.astype(carry[0].dtype), new

    writes = 1 if k == 0 else k  # the new states, or the k snapshots
    floor = (cfg.weight_bytes() + (1 + writes) * b * cfg.state_bytes()) / common.bandwidth() * 1e6
    return step, (x, pool), floor


def bench_pool(cfg, params, batches, n, reps, records, meta):
    """Decode from a pool of 2B slots against FLA's layer decode step, and decode_k k = 4 at
    B = 64 from a pool of 128."""
    try:
        layer = common.fla_layer(cfg, cfg.gate_lower_bound)
    except Exception as e:  # noqa: BLE001 - the reason is printed and baseline is null
        layer = None
        print(f"[decode_pool] FLA layer unavailable: {e!r}", file=sys.stderr)
    times = {}
    for b in batches:
        fla = None
        if layer is not None:
            try:
                fla = common.fla_layer_decode_us(layer, b, reps=reps)
            except Exception as e:  # noqa: BLE001 - printed, baseline null
                print(f"[decode_pool B={b}] FLA failed: {e!r}", file=sys.stderr)
        step, carry, floor = pool_case(cfg, params, b, jax.random.key(300 + b))
        run = functools.partial(common.time_loop, step, carry, n, reps, differential=True)
        base = None if fla is None else min(fla.values())
        kind = None if fla is None else min(fla, key=fla.get)
        times[b] = common.run_case(
            records,
            meta,
            "decode_pool",
            f"B={b},N={2 * b},D={cfg.hidden},H={cfg.heads},K={cfg.head_dim}",
            "pallas",
            run,
            floor,
            base,
            f"{common.FLA_LAYER_NAME} decode ({'CUDA graph' if kind == 'graph' else 'eager'})",
            vs_baseline=lambda us, f=base: None if f is None else round(us / f, 3),
            fla_eager_us=None if fla is None else fla["eager"],
            fla_graph_us=None if fla is None else fla["graph"],
        )
        del carry
    b, k = 64, 4
    step, carry, floor = pool_case(cfg, params, b, jax.random.key(400), k=k)
    run = functools.partial(common.time_loop, step, carry, n, reps, differential=True)
    common.run_case(
        records,
        meta,
        "decode_k_pool",
        f"B={b},k={k},N={2 * b},D={cfg.hidden},H={cfg.heads}",
        "pallas",
        run,
        floor,
        times.get(b),
        "pallas decode_pool (one token)",
    )


def _core_inputs(b, h, kd, key):
    """bf16 raw q, k, v, f, z [B, 1, ...], beta logits, fp32 params (FLA's input set + z, w:
    the block's decode_core takes them; the benchmark's core, without the RMSNorm, reads
    neither)."""
    ks = jax.random.split(key, 9)
    bf = jnp.bfloat16
    rows = lambda i, *s: jax.random.normal(ks[i], (b, 1, *s), jnp.float32).astype(bf)  # noqa
    q, k, v = rows(0, h, kd), rows(1, h, kd), rows(2, h, kd)
    f, z, beta = rows(3, h * kd), rows(4, h * kd), rows(5, h)
    a_log = jnp.log(jax.random.uniform(ks[6], (h,), jnp.float32, 0.5, 1.5))
    dt_bias = jax.random.normal(ks[7], (h * kd,), jnp.float32) - 3.0
    w = 1.0 + 0.1 * jax.random.normal(ks[8], (kd,), jnp.float32)
    state = 0.1 * jax.random.normal(ks[0], (b, h, kd, kd), jnp.float32)
    return (q, k, v, f, beta, z), (a_log, dt_bias, w), state


def core_floor_us(acts, state) -> float:
    """The decode core's traffic at full bandwidth, as FLA's kernel moves it: the fp32 state
    read and written, q, k, v, f, beta read and o (the size of v) written in bf16."""
    q, k, v, f, beta, _ = acts
    io_bytes = sum(a.size * a.dtype.itemsize for a in (q, k, v, f, beta)) + v.size * 2
    return (2 * state.size * 4 + io_bytes) / common.bandwidth() * 1e6


def core_carry(acts, state):
    """The core loop's carry: the state and the read-out o [B, 1, P] fp32 (zeros to start)."""
    return state + 0.0, jnp.zeros(acts[-1].shape, jnp.float32)


def fla_core_us(b, h, kd, reps):
    """FLA's fused_recurrent_kda, as SPEC §9 took its figures; raises if fla is missing."""
    return common.cuda_graph_us(fla_core_call(b, h, kd), reps)


def fla_core_call(b, h, kd):
    """A callable running FLA's fused_recurrent_kda on fresh [b, 1, h, kd] inputs, as SPEC §9
    called it; raises if fla is missing."""
    import torch
    from fla.ops.kda import fused_recurrent_kda

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(b)
    rnd = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen, device=dev).to(dt)  # noqa
    q, k, v, g = (rnd(b, 1, h, kd) for _ in range(4))
    beta = rnd(b, 1, h)
    a_log = rnd(h, dt=torch.float32)
    dt_bias = rnd(h * kd, dt=torch.float32)
    h0 = 0.1 * rnd(b, h, kd, kd, dt=torch.float32)

    def call():
        # fla 0.6.0's public wrapper takes inplace_final_state through **kwargs (SPEC §9 call).
        return fused_recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=a_log,
            dt_bias=dt_bias,
            initial_state=h0,
            inplace_final_state=True,
            **common.FLA_OPTIONS,
        )

    return call


def core_kwargs(cfg) -> dict:
    """The static arguments of the decode core steps below."""
    return dict(
        scale=cfg.scale,
        lower_bound=cfg.gate_lower_bound,
        eps=cfg.rms_norm_eps,
        snapshots=False,
        out_dtype=jnp.bfloat16,
    )


def bench_core(cfg, batches, n, reps, records, meta, tiles=()):
    """Decode core against FLA at each B: the default V tile, then the other `tiles` (V tile
    widths; None: all of V, V/2, V/4, V/8)."""
    h, kd = cfg.heads, cfg.head_dim
    kw = core_kwargs(cfg)

    for b in batches:
        try:
            fla = fla_core_us(b, h, kd, reps)
        except Exception as e:  # noqa: BLE001 - the reason is printed and baseline is null
            fla = None
            print(
                f"[decode_core B={b}] FLA baseline unavailable: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
        acts, params, state = _core_inputs(b, h, kd, jax.random.key(b))
        floor = core_floor_us(acts, state)
        shape = f"B={b},H={h},K={kd},R=1"
        default = RecurrentBlockSizes.get_default(b, h, kd, kd)
        variants = [(f"pallas[block_v={default.block_v}]", default)] + [
            (f"pallas[block_v={bv}]", RecurrentBlockSizes.with_block_v(kd, bv))
            for bv in ((kd, kd // 2, kd // 4, kd // 8) if tiles is None else tiles)
            if bv != default.block_v
        ]
        for name, block in variants:
            step = functools.partial(_pallas_core_step, acts, params, kw, cfg.l2_eps, block)
            carry = core_carry(acts, state)
            run = functools.partial(common.time_loop, step, carry, n, reps, differential=True)
            common.run_case(
                records, meta, "decode_core", shape, name, run, floor, fla, FLA_NAME, note=CORE_NOTE
            )
        step = functools.partial(_xla_core_step, acts, params, kw, cfg.l2_eps)
        carry = core_carry(acts, state)
        run = functools.partial(common.time_loop, step, carry, n, reps, differential=True)
        common.run_case(
            records, meta, "decode_core", shape, "xla", run, floor, fla, FLA_NAME, note=CORE_NOTE
        )


# Carried by every decode_core record: what its two timings are, and where they part.
CORE_NOTE = (
    "wall clock: ours per step of a jitted loop (differential), FLA per call of a CUDA-graph "
    "replay; below ~15 us the two methods differ by more than the kernels do: the "
    "decode_core_device records (decode_profile.py, CUPTI) compare them by device time"
)


def _pallas_core_step(acts, params, kw, l2_eps, block, carry):
    """Raw q, k L2-normalised in the recurrent kernel, gate and beta fused, no RMSNorm: one
    launch. carry: (state, o) -> (new state, read-out o [B, 1, P] fp32)."""
    q, k, v, f, beta, _ = acts
    a_log, dt_bias, _ = params
    o, new_state, _ = fused_recurrent(
        q,
        k,
        v,
        f,
        beta,
        carry[0],
        a_log,
        dt_bias,
        scale=kw["scale"],
        lower_bound=kw["lower_bound"],
        l2_eps=l2_eps,
        block_sizes=block,
    )
    return new_state, o.reshape(carry[1].shape)


def _xla_core_step(acts, params, kw, l2_eps, carry):
    """The same work from the references: L2, gate + beta, recurrence and read-out."""

    def l2(x):
        x = x.astype(jnp.float32)
        return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + l2_eps)

    q, k, v, f, beta, _ = acts
    a_log, dt_bias, _ = params
    g, b = ref.gate_reference(
        f, beta, a_log, dt_bias, head_dim=q.shape[-1], lower_bound=kw["lower_bound"]
    )
    o, new_state, _ = ref.recurrent_reference(l2(q), l2(k), v, g, b, carry[0], scale=kw["scale"])
    return new_state, o.reshape(carry[1].shape)


def bench_conv(cfg, params, batches, n, reps, records, meta, tiles=False):
    """conv_decode alone: the conv state is the carry (read and written each step); pallas at
    the default tiling (with `tiles`, a few others: block_heads x num_warps), and xla."""
    from pallas_kernels.conv import ConvBlockSizes, conv_decode

    kw = dict(qk_channels=cfg.qk_channels, head_dim=cfg.head_dim, l2_eps=cfg.l2_eps)
    for b in batches:
        key = jax.random.key(200 + b)
        qkv = jax.random.normal(key, (b, 1, cfg.conv_dim), jnp.float32).astype(jnp.bfloat16)
        conv0 = random_state(cfg, b, key).conv
        # raw inputs (bf16) and q|k|v out (fp32) once, the conv state read and written.
        floor = (qkv.size * 2 + qkv.size * 4 + 2 * conv0.size * 4) / common.bandwidth() * 1e6
        groups = cfg.conv_dim // cfg.head_dim
        default = ConvBlockSizes.get_default(1, groups, cfg.head_dim)
        variants = [("pallas", conv_decode)] + [
            (
                f"pallas[heads={hb},warps={nw}]",
                functools.partial(
                    conv_decode, block_sizes=ConvBlockSizes(block_heads=hb, num_warps=nw)
                ),
            )
            for hb, nw in ((1, 1), (1, 4), (2, 4), (4, 4), (8, 8))
            if tiles and (hb, nw) != (default.block_heads, default.num_warps)
        ]
        for backend, fn in [*variants, ("xla", ref.conv_decode_reference)]:

            def step(state, fn=fn, qkv=qkv):
                return fn(qkv, state, params.conv_w, **kw)[1]

            run = functools.partial(common.time_loop, step, conv0 + 0.0, n, reps, differential=True)
            shape = f"B={b},R=1,C={cfg.conv_dim}"
            common.run_case(records, meta, "conv_decode", shape, backend, run, floor, None, "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", help="write this run's records here (default: merge into benchmarks/results/)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer repetitions (with --tiles: V tiles 32, 64)"
    )
    parser.add_argument(
        "--tiles",
        action="store_true",
        help="also time the non-default tilings of the decode core and conv_decode (tuning)",
    )
    parser.add_argument(
        "--pool",
        action="store_true",
        help="only the slot-pool cases: decode at B = 1..1024 from a pool of 2B against FLA's "
        "layer, decode_k k=4 at B=64",
    )
    args = parser.parse_args()
    cfg = preset("kimi-linear-48b")
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    meta = common.meta()
    batches = (1, 8, 64)  # the decode targets' sizes, quick or not
    reps = 3 if args.quick else 7
    # 64 steps per loop even when quick: with 16, the B = 1 core's T(3n) - T(n) was noisier
    # than the step itself (2026-12-01, the records' note).
    records = common.Records(args.out)
    tiles = ((32, 64) if args.quick else None) if args.tiles else ()
    if args.pool:
        bench_pool(cfg, params, POOL_BATCHES, 64, reps, records, meta)
    else:
        bench_core(cfg, batches, 64, reps, records, meta, tiles=tiles)
        bench_block(cfg, params, batches, 64, reps, records, meta)
        bench_conv(cfg, params, batches, 64, reps, records, meta, tiles=args.tiles)
    print(
        f"\n{'bench':<12}{'shape':<34}{'backend':<22}{'time_us':>9}{'floor_us':>9}"
        f"{'x_floor':>8}  baseline"
    )
    for r in records:
        t = r["time_us"]
        base = r["baseline"]
        base_s = "-" if base is None else f"{base['name']}: {base['time_us']} us"
        x_floor = "-" if t is None else f"{t / r['floor_us']:.2f}"
        t_s = "FAILED" if t is None else f"{t:.1f}"
        print(
            f"{r['bench']:<12}{r['shape']:<34}{r['backend']:<22}{t_s:>9}"
            f"{r['floor_us']:>9.1f}{x_floor:>8}  {base_s}"
        )
    print(f"wrote {len(records)} records to {records.where()}")


if __name__ == "__main__":
    main()
