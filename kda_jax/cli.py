"""`kda-jax` / `python -m kda_jax`: build a block, run prefill, a jit decode loop and a verify,
and check every stage against the fp32 oracle.

With no arguments it uses the tiny built-in config and random weights (seconds on a CPU).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kda_jax import backends, forward
from kda_jax.config import PRESETS, preset
from kda_jax.oracle import STAGES, oracle_forward
from kda_jax.params import init_params
from kda_jax.state import KdaState

_DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, no usage dump
        print(f"kda-jax: error: {message} (see kda-jax --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kda-jax", description=__doc__)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)} (default tiny)")
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face checkpoint directory")
    ap.add_argument("--layer", type=int, default=None, help="layer index in the checkpoint")
    ap.add_argument(
        "--backend",
        choices=backends.BACKENDS,
        default=None,
        help="default: pallas on a GPU, xla elsewhere",
    )
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weight dtype")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens (prefill)")
    ap.add_argument("--decode", type=int, default=16, help="tokens in the jit decode loop")
    ap.add_argument("--verify", type=int, default=4, help="k of the speculative verify")
    ap.add_argument("--seed", type=int, default=0)
    return ap


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


def run(args: argparse.Namespace) -> int:
    for name in ("batch", "prompt", "decode", "verify"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 1")
    dtype = _DTYPES[args.dtype]
    backend = backends.resolve(args.backend)
    if args.checkpoint:
        from kda_jax.hf import load_hf_params

        if args.layer is None:
            raise ValueError("--checkpoint needs --layer (the model.layers.{i} index)")
        cfg, params = load_hf_params(args.checkpoint, args.layer, dtype=dtype)
        source = f"{args.checkpoint} layer {args.layer}"
    else:
        if args.layer is not None:
            raise ValueError("--layer only applies with --checkpoint")
        cfg = preset(args.preset)
        params = init_params(cfg, jax.random.key(args.seed), dtype)
        source = f"preset {args.preset}, random weights"
    if args.verify > cfg.max_verify:
        raise ValueError(f"--verify={args.verify} exceeds max_verify={cfg.max_verify}")
    b, t, n, k = args.batch, args.prompt, args.decode, args.verify
    _say(
        f"kda-jax: {source}; D={cfg.hidden} H={cfg.heads} K={cfg.head_dim} "
        f"gate={'bounded' if cfg.bounded_gate else 'unbounded'}; backend={backend} "
        f"dtype={args.dtype} device={jax.devices()[0].device_kind}"
    )
    keys = jax.random.split(jax.random.key(args.seed + 1), 3)
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
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kda-jax: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
