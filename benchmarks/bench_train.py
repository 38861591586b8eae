"""Training timings on one GPU: forward + backward of the core and of the whole block.

Cases (H=32, K=V=128, both gates; B=1 T=8192, B=4 T=4096, B=8 T=2048):
- `train_core`: gate + beta + L2 of q, k + chunked recurrence (`chunk_kda_reference`),
  gradients of q, k, v, the raw gate, beta, A_log, dt_bias and the initial state for a fixed
  random cotangent of o and of the final state. Backends: `xla` (every stage XLA's, the state
  pass a `lax.scan`) and `pallas` (what the pallas backend trains through: the chunked core
  on the Pallas kernels of `chunk_vjp`, forward and backward).
  Baseline: FLA 0.6.0 `chunk_kda` (SPEC §9 options) on the same arrays, `o.backward` through
  torch autograd with the same cotangents, eager (autograd does not replay as a CUDA graph).
- `train_block`: `forward.prefill` (kimi-linear-48b geometry, bf16 weights), gradients of every
  parameter, of x and of the carried state; backend `pallas` (the kernels forward, the xla
  path's VJP backward) and `xla`. Baseline: FLA 0.6.0's `KimiDeltaAttention` layer in training
  mode on the same geometry, `y.backward` with a random cotangent, eager.
Floors: 3x the forward's FLOP floor (bench_prefill.py's count; a backward does about twice a
forward's products) at 790 TFLOP/s. `peak_mib`: XLA's temporaries of the compiled fwd+bwd
(`memory_analysis`), and for FLA the peak allocated during one fwd+bwd above what was held before.

JAX timing: one jitted `fori_loop` of n dependent steps (each step's gradients move its inputs,
so nothing is loop-invariant), median over repetitions, divided by n.

Usage: python benchmarks/bench_train.py [--quick] [--core-only | --block-only] [--out PATH]
                                        [--gates bounded,unbounded] [--shapes 1x8192,4x4096]
                                        [--backends pallas,xla]
Records merge into benchmarks/results/train_core.json and train_block.json.
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
from bench_prefill import (  # noqa: E402
    L2_EPS,
    LB,
    PEAK,
    block_case,
    block_flops,
    block_inputs,
    chunk_flops,
    core_inputs,
)

from kda_jax import forward  # noqa: E402
from kda_jax.backends import vjp_core  # noqa: E402
from kda_jax.config import DEFAULT_CHUNK  # noqa: E402
from pallas_kernels import reference as ref  # noqa: E402

SHAPES = [(1, 8192), (4, 4096), (8, 2048)]
FLA_CORE = "fla-0.6.0 chunk_kda fwd+bwd (torch autograd, eager)"
FLA_LAYER = f"{common.FLA_LAYER_NAME} fwd+bwd (train mode, eager)"
MIB = 2**20


def _l2(a):
    a = a.astype(jnp.float32)
    return a * jax.lax.rsqrt(jnp.sum(a * a, -1, keepdims=True) + L2_EPS)


def core_loss(inputs, cts, lower_bound, chunk=DEFAULT_CHUNK, kernels=False):
    """<o, do> + <final state, ds> of the core on FLA's input set; kernels: the chunked core on
    `chunk_vjp`'s kernels (what the pallas backend differentiates)."""
    q, k, v, g, beta, a_log, dt_bias, h0 = inputs
    do, ds = cts
    b, t, h, kd = q.shape
    gate, bet = ref.gate_reference(
        g.reshape(b, t, h * kd), beta, a_log, dt_bias, head_dim=kd, lower_bound=lower_bound
    )
    core = vjp_core() if kernels else ref.chunk_kda_reference
    o, st = core(_l2(q), _l2(k), v.astype(jnp.float32), gate, bet, h0, scale=kd**-0.5, chunk=chunk)
    return jnp.sum(o * do) + jnp.sum(st * ds)


def _moved(tree, grads):
    """Each input moved a little along its gradient (in its own dtype)."""
    return jax.tree.map(lambda a, g: (a - 1e-6 * g.astype(a.dtype)).astype(a.dtype), tree, grads)


def _temp_mib(fn, *args) -> float:
    return round(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / MIB)


def fla_core_train_us(inputs, cts, lower_bound, reps) -> tuple[float, float]:
    """(µs per FLA chunk_kda fwd+bwd, peak MiB above the resident set)."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    extra = {} if lower_bound is None else dict(safe_gate=True, lower_bound=lower_bound)
    leaves = [torch.from_dlpack(x).clone().requires_grad_(True) for x in inputs]
    do = torch.from_dlpack(cts[0]).to(torch.bfloat16)  # FLA's o is bf16 (v is)
    ds = torch.from_dlpack(cts[1])

    def call():
        q, k, v, g, beta, a_log, dt_bias, h0 = leaves
        o, st = fla_chunk_kda(
            q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, initial_state=h0,
            **common.FLA_OPTIONS, **extra,
        )  # fmt: skip
        torch.autograd.backward((o, st), (do, ds))
        for x in leaves:
            x.grad = None

    return _torch_train_us(call, reps)


def _torch_train_us(call, reps) -> tuple[float, float]:
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    return common._event_us(call, reps), round(peak)


def bench_core(shapes, gates, backends, n, reps, records, meta, h=32, kd=128):
    for gate in gates:
        lb = LB if gate == "bounded" else None
        for b, t in shapes:
            inputs = core_inputs(b, t, h, kd, jax.random.key(b * t))
            kc = jax.random.split(jax.random.key(7), 2)
            cts = (
                jax.random.normal(kc[0], (b, t, h, kd), jnp.float32),
                jax.random.normal(kc[1], (b, h, kd, kd), jnp.float32),
            )
            fla, fla_mib = None, None
            try:
                fla, fla_mib = fla_core_train_us(inputs, cts, lb, reps)
            except Exception as e:  # noqa: BLE001 - printed, baseline null
                print(f"[train_core B={b} T={t} {gate}] FLA failed: {e!r}", file=sys.stderr)
            for backend in backends:
                kernels = backend == "pallas"
                grad = jax.grad(functools.partial(core_loss, lower_bound=lb, kernels=kernels))

                def step(cts, inputs, grad=grad):
                    return _moved(inputs, grad(inputs, cts))

                run = functools.partial(common.time_loop, step, inputs, n, reps, consts=cts)
                common.run_case(
                    records, meta, "train_core", f"B={b},T={t},H={h},K={kd},gate={gate}",
                    backend, run, 3 * b * chunk_flops(1, t, h, kd, kd) / PEAK * 1e6, fla,
                    FLA_CORE, vs_baseline=lambda us, f=fla: None if f is None else round(us / f, 3),
                    peak_mib=_temp_mib(grad, inputs, cts), fla_peak_mib=fla_mib,
                )  # fmt: skip
            del inputs, cts


def block_loss(params, x, state, cts, cfg, backend):
    """<y, dy> + <final recurrent state, ds> of the block."""
    y, st = forward.prefill(params, cfg, x, state, backend=backend)
    dy, ds = cts
    return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(st.recurrent * ds)


def fla_layer_train_us(layer, b, t, reps) -> tuple[float, float]:
    """(µs per FLA layer fwd+bwd in training mode, peak MiB above the resident set)."""
    import torch

    layer.train()
    x = torch.randn(b, t, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn_like(x)

    def call():
        y = layer(x)[0]
        y.backward(dy)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    try:
        return _torch_train_us(call, reps)
    finally:
        layer.eval()


def bench_block(shapes, gates, backends, n, reps, records, meta):
    for gate in gates:
        cfg, params, layer = block_case(gate, "train_block")
        for b, t in shapes:
            fla, fla_mib = None, None
            if layer is not None:
                try:
                    fla, fla_mib = fla_layer_train_us(layer, b, t, reps)
                except Exception as e:  # noqa: BLE001 - printed, baseline null
                    print(f"[train_block B={b} T={t} {gate}] FLA failed: {e!r}", file=sys.stderr)
            x, state = block_inputs(cfg, b, t, jax.random.key(b * t))
            k1, k2 = jax.random.split(jax.random.key(b * t + 1))
            cts = (
                jax.random.normal(k1, (b, t, cfg.hidden), jnp.float32),
                jax.random.normal(k2, cfg.recurrent_state_shape(b), jnp.float32),
            )
            for backend in backends:
                grad = jax.grad(
                    functools.partial(block_loss, cfg=cfg, backend=backend), argnums=(0, 1, 2)
                )

                def step(cts, carry, grad=grad):
                    return _moved(carry, grad(*carry, cts))

                carry = (params, x, state)
                run = functools.partial(common.time_loop, step, carry, n, reps, consts=cts)
                mib = _temp_mib(grad, params, x, state, cts)
                common.run_case(
                    records, meta, "train_block",
                    f"B={b},T={t},D={cfg.hidden},H={cfg.heads},gate={gate}", backend, run,
                    3 * b * block_flops(cfg, t) / PEAK * 1e6, fla, FLA_LAYER,
                    vs_baseline=lambda us, f=fla: None if f is None else round(us / f, 3),
                    tokens_per_s=lambda us, bt=b * t: round(bt / us * 1e6),
                    peak_mib=mib, fla_peak_mib=fla_mib,
                )  # fmt: skip
            del x, state, cts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write this run's records here (default: merge)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--core-only", action="store_true")
    only.add_argument("--block-only", action="store_true")
    parser.add_argument("--gates", default="unbounded,bounded")
    parser.add_argument("--backends", default="pallas,xla")
    parser.add_argument(
        "--shapes",
        type=lambda x: [tuple(int(v) for v in s.split("x")) for s in x.split(",")],
        default=SHAPES,
        help="shapes as BxT, e.g. 1x8192",
    )
    args = parser.parse_args()
    gates = [g for g in args.gates.split(",") if g]
    if not set(gates) <= {"bounded", "unbounded"}:
        parser.error(f"--gates: expected bounded and/or unbounded, got {args.gates!r}")
    backends = [b for b in args.backends.split(",") if b]
    if not set(backends) <= {"pallas", "xla"}:
        parser.error(f"--backends: expected pallas and/or xla, got {args.backends!r}")
    meta = common.meta()
    n, reps = (2, 3) if args.quick else (3, 5)
    records = common.Records(args.out)
    if not args.block_only:
        bench_core(args.shapes, gates, backends, n, reps, records, meta)
    if not args.core_only:
        bench_block(args.shapes, gates, backends, n, reps, records, meta)
    print(f"wrote {len(records)} records to {records.where()}")


if __name__ == "__main__":
    main()
