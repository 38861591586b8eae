"""`kda-jax` / `python -m kda_jax`: build a block, run prefill, a jit decode loop and a verify,
and check every stage against the fp32 oracle.

With no arguments it uses the tiny built-in config and random weights (seconds on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import operator
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import backends, forward
from kda_jax.config import PRESETS, KdaConfig, preset
from kda_jax.oracle import STAGES, oracle_forward
from kda_jax.params import KdaParams, init_params
from kda_jax.state import KdaState

_DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
SEED_LIMIT = 2**32  # jax.random.key takes a uint32 seed


class UsageError(Exception):
    """A user error: `main` prints it as one `kda-jax: error: ...` line and exits with 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, no usage dump
        raise UsageError(f"{message} (see kda-jax --help)")


def _integer(text: str) -> int:
    """argparse type: an integer, written as 12, 1_000 or 1e9 (an exact integer in any form)."""
    try:
        value = decimal.Decimal(text.replace("_", ""))
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} is not an integer")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kda-jax", description=__doc__)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)} (default tiny)")
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face checkpoint directory")
    ap.add_argument("--layer", type=_integer, default=None, help="layer index in the checkpoint")
    ap.add_argument(
        "--backend",
        choices=backends.BACKENDS,
        default=None,
        help="default: pallas on a GPU, xla elsewhere",
    )
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weight dtype")
    ap.add_argument("--batch", type=_integer, default=2, help="sequences B")
    ap.add_argument("--prompt", type=_integer, default=100, help="prompt tokens (prefill)")
    ap.add_argument("--decode", type=_integer, default=16, help="tokens in the jit decode loop")
    ap.add_argument("--verify", type=_integer, default=4, help="k of the speculative verify")
    ap.add_argument("--seed", type=_integer, default=0, help="in [0, 2**32), default 0")
    return ap


@dataclasses.dataclass(frozen=True)
class Job:
    """A run whose every argument has been checked."""

    cfg: KdaConfig
    source: str
    backend: str
    dtype_name: str
    batch: int
    prompt: int
    decode: int
    verify: int
    seed: int
    need_bytes: int


def estimate_bytes(cfg: KdaConfig, itemsize: int, batch: int, tokens: int, verify: int) -> int:
    """A generous estimate of the peak memory of one run of `tokens` tokens per sequence.

    Per token and sequence: the stages (STAGES, 12P + H + D fp32) four times (the oracle's scan
    output and its transposed copy, the prefill's stages, the comparisons' copies), the chunk
    intermediates (w, u and the [C, C] blocks) and the input; per sequence the states (initial,
    prefill, decode, three oracle states, `verify` snapshots); the weights in their dtype and as
    the oracle's fp32 copy. On the tiny preset on a CPU it matches, within a few percent, how the
    process's resident memory grows with the prompt length.
    """
    p, h, d, c = cfg.qkv_dim, cfg.heads, cfg.hidden, cfg.chunk
    stages = 12 * p + h + d
    per_token = 4 * (4 * stages + 4 * p + 2 * h * c + 2 * d)
    per_seq = cfg.state_bytes(1) * (verify + 6)
    weights = cfg.weight_bytes(itemsize) + cfg.weight_bytes(4)
    return weights + batch * (tokens * per_token + per_seq)


def _memory_limit() -> tuple[int, str]:
    """(bytes, what) the run may use: the device's allocator limit, or the host's RAM."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"device memory on the {dev.device_kind}"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory (RAM)"


def _as_int(args: argparse.Namespace, name: str, low: int, high: int | None = None) -> int:
    """args.<name> as a Python int in [low, high) (numpy integers accepted), else UsageError."""
    value = getattr(args, name)
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise UsageError(f"--{name}={value!r} must be an int") from None
    if value < low:
        raise UsageError(f"--{name}={value} must be >= {low}")
    if high is not None and value >= high:
        raise UsageError(f"--{name}={value} must be < {high} (2**{high.bit_length() - 1})")
    return value


def prepare(args: argparse.Namespace) -> tuple[Job, KdaParams]:
    """Checks every argument before any work, then loads the weights. Raises UsageError
    (or a loader's ValueError / OSError) naming the argument, the value and the limit."""
    b = _as_int(args, "batch", 1)
    t = _as_int(args, "prompt", 1)
    n = _as_int(args, "decode", 1)
    k = _as_int(args, "verify", 1)
    seed = _as_int(args, "seed", 0, SEED_LIMIT)
    layer = None if args.layer is None else _as_int(args, "layer", 0)
    if args.dtype not in _DTYPES:
        raise UsageError(f"--dtype={args.dtype!r}, expected one of {sorted(_DTYPES)}")
    dtype = _DTYPES[args.dtype]
    try:
        backend = backends.resolve(args.backend)
    except ValueError as e:
        raise UsageError(f"--backend: {e}") from None
    if args.checkpoint and layer is None:
        raise UsageError("--checkpoint needs --layer (the model.layers.{i} index)")
    if not args.checkpoint and layer is not None:
        raise UsageError("--layer only applies with --checkpoint")
    if args.checkpoint:
        from kda_jax.hf import read_hf_config

        cfg, _ = read_hf_config(args.checkpoint)
        source = f"{args.checkpoint} layer {layer}"
    else:
        cfg = preset(args.preset)
        source = f"preset {args.preset}, random weights"
    if k > cfg.max_verify:
        raise UsageError(f"--verify={k} exceeds max_verify={cfg.max_verify}")
    itemsize = jnp.dtype(dtype).itemsize
    need = estimate_bytes(cfg, itemsize, b, t + n + k, k)
    have, where = _memory_limit()
    if need > have:
        raise UsageError(
            f"--batch={b} --prompt={t} --decode={n} --verify={k}: the run needs about {need} "
            f"bytes ({need / 2**30:.1f} GiB, estimated from D={cfg.hidden} H={cfg.heads} "
            f"K={cfg.head_dim}), more than the {have} bytes of {where}"
        )
    job = Job(cfg, source, backend, args.dtype, b, t, n, k, seed, need)
    # Every argument is good: the weights are the first work.
    if args.checkpoint:
        from kda_jax.hf import load_hf_params

        cfg, params = load_hf_params(args.checkpoint, layer, cfg, dtype=dtype)
    else:
        params = init_params(cfg, jax.random.key(seed), dtype)
    return job, params


def _rel(got, ref) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _timed(fn, *args):
    """Runs fn twice (compile, then steady state); returns (result, seconds of the second run)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(job: Job, params: KdaParams) -> int:
    """The main job: oracle, prefill, jit decode loop and verify, each stage against the oracle.
    Returns 0 when every stage is within the bar, 1 otherwise."""
    cfg, backend, dtype = job.cfg, job.backend, _DTYPES[job.dtype_name]
    b, t, n, k = job.batch, job.prompt, job.decode, job.verify
    _say(
        f"kda-jax: {job.source}; D={cfg.hidden} H={cfg.heads} K={cfg.head_dim} "
        f"gate={'bounded' if cfg.bounded_gate else 'unbounded'}; backend={backend} "
        f"dtype={job.dtype_name} device={jax.devices()[0].device_kind}"
    )
    keys = jax.random.split(jax.random.fold_in(jax.random.key(job.seed), 1), 3)
    xs = jax.random.normal(keys[0], (b, t + n + k, cfg.hidden), jnp.float32).astype(dtype)
    s0 = KdaState.zeros(cfg, b)
    bar = 1e-2 if dtype == jnp.bfloat16 else (1e-3 if jax.default_backend() == "gpu" else 1e-4)
    rows = []

    _say(f"[1/4] oracle over {t + n + k} tokens ...")
    _, _, ref = oracle_forward(params, cfg, xs, s0)
    _, ref_state_t, _ = oracle_forward(params, cfg, xs[:, :t], s0)
    _, ref_state_tn, _ = oracle_forward(params, cfg, xs[:, : t + n], s0)

    _say(f"[2/4] prefill of {t} tokens ...")
    (y, state, stages), sec = _timed(
        lambda x, s: forward.prefill(params, cfg, x, s, backend=backend, return_stages=True),
        xs[:, :t],
        s0,
    )
    for name in (n for n in STAGES if n in stages):
        got = stages[name]
        timed = sec if name == "final_out" else None
        rows.append((f"prefill {name}", _rel(got, ref[name][:, :t]), timed))
    rows.append(("prefill state", _rel(state.recurrent, ref_state_t.recurrent), None))

    _say(f"[3/4] jit decode loop of {n} tokens ...")

    @jax.jit
    def loop(state, xs_dec):
        def body(i, carry):
            s, ys = carry
            y_i, s = forward.decode(params, cfg, xs_dec[:, i], s, backend=backend)
            return s, ys.at[:, i].set(y_i.astype(jnp.float32))

        ys = jnp.zeros((b, n, cfg.hidden), jnp.float32)
        return jax.lax.fori_loop(0, n, body, (state, ys))

    (dec_state, ys), sec = _timed(loop, state, xs[:, t : t + n])
    rows.append(("decode final_out", _rel(ys, ref["final_out"][:, t : t + n]), sec / n))
    rows.append(("decode state", _rel(dec_state.recurrent, ref_state_tn.recurrent), None))

    _say(f"[4/4] verify of k={k} tokens ...")
    (yk, _, snaps), sec = _timed(
        lambda x, s: forward.decode_k(params, cfg, x, s, backend=backend),
        xs[:, t + n :],
        dec_state,
    )
    rows.append(("verify final_out", _rel(yk, ref["final_out"][:, t + n :]), sec))
    _, ref_snap, _ = oracle_forward(params, cfg, xs[:, t + n : t + n + 1], ref_state_tn)
    rows.append(("verify snapshot[0]", _rel(snaps.recurrent[:, 0], ref_snap.recurrent), None))

    _say(f"\n{'stage':<24}{'rel err':>11}{'bar':>9}{'time':>12}")
    failed = []
    for name, err, sec in rows:
        # Stage errors accumulate along the path; each is held to the end-to-end bar.
        ok = err < bar
        failed += [] if ok else [name]
        tstr = "" if sec is None else f"{sec * 1e3:9.2f} ms"
        _say(f"{name:<24}{err:>11.2e}{bar:>9.0e}{tstr:>12}{'' if ok else '  FAIL'}")
    if failed:
        _say(f"\nFAILED against the oracle: {', '.join(failed)}")
        return 1
    _say("\nall stages within the bar against the fp32 oracle")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the job; user errors print one `kda-jax: error: ...` line and return 2."""
    try:
        args = _parser().parse_args(argv)
        job, params = prepare(args)
    except (UsageError, ValueError, OSError) as e:
        print(f"kda-jax: error: {e}", file=sys.stderr)
        return 2
    try:
        return run(job, params)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(
            f"kda-jax: error: out of memory (the run was estimated at {job.need_bytes} bytes): "
            f"{str(e).splitlines()[0]}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
