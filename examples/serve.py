"""Continuous batching over a slot-indexed state pool: one jit-compiled engine step per tick.

A server keeps every running sequence's KDA state in one preallocated pool (`KdaState` with N
rows) and names rows by slot. Each engine step takes the prompts that arrived (at most
`max_prompts` of at most `bucket` tokens each, packed back to back in one buffer of
`max_prompts * bucket` tokens with their offsets, `cu_seqlens`) and one new input per running
sequence (at most `max_decode`), resets the arrivals' slots, prefills them (`prefill_packed`:
the work of their tokens, not of `max_prompts` padded prompts) and decodes the running ones,
all against the pool, which the step donates so XLA updates it in place. Rows and prompts with
slot -1 are padding: they write nothing. The host schedules: it admits arrivals into free
slots, retires sequences that produced their tokens and frees their slots.

There is no LM head here: a sequence's next input is its last output, RMS-normalised, so the
loop runs the block exactly as a model's decode loop would (one input per step, the state
carried in the pool). The arrival trace is synthetic (a fixed seed). At the end one retired
sequence is checked: its state, read from the pool as it retired, against one `prefill` of
all its inputs from a fresh state.

    .venv/bin/python examples/serve.py                        # tiny config, xla backend (CPU)
    python examples/serve.py --preset kimi-linear-48b         # on a GPU: pallas, bf16 weights
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kda_jax as K

__all__ = ["EngineConfig", "Request", "make_trace", "make_step", "serve"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine: `slots` pool rows, at most `max_prompts` arrivals per step (each at
    most `bucket` tokens, packed into one buffer of max_prompts * bucket tokens) and
    `max_decode` running sequences."""

    slots: int = 16
    max_prompts: int = 2
    bucket: int = 48
    max_decode: int = 8


@dataclasses.dataclass
class Request:
    """One synthetic request: it arrives at step `arrival` with `prompt_len` tokens and wants
    `gen_len` decoded tokens; `seed` draws its prompt embeddings."""

    rid: int
    arrival: int
    prompt_len: int
    gen_len: int
    seed: int


def make_trace(n: int, steps: int, bucket: int, max_gen: int, seed: int = 0) -> list[Request]:
    """n requests arriving uniformly over the first `steps` steps, prompt lengths in
    [1, bucket], generation lengths in [1, max_gen]."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.integers(0, max(1, steps), n))
    return [
        Request(i, int(a), int(rng.integers(1, bucket + 1)), int(rng.integers(1, max_gen + 1)), i)
        for i, a in enumerate(arrivals)
    ]


def _next_input(y: jax.Array) -> jax.Array:
    """A sequence's next input from its last output: RMS-normalised (stays O(1))."""
    y = y.astype(jnp.float32)
    return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)


def make_step(cfg: K.KdaConfig, backend: str | None):
    """The engine step, jitted with the pool donated: (params, pool, packed prompts [A*P, D],
    their offsets cu_seqlens [A + 1], prompt slots [A], inputs [M, D], slots [M]) -> (the
    prompts' next inputs [A, D], the running rows' next inputs [M, D], pool)."""

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, pool, px, cu, pslots, dx, dslots):
        fresh = jnp.where(pslots >= 0, pslots, pool.recurrent.shape[0])  # -1: dropped
        pool = jax.tree.map(lambda a: a.at[fresh].set(0.0, mode="drop"), pool)
        yp, pool = K.prefill_packed(params, cfg, px, cu, pool, slots=pslots, backend=backend)
        last = yp[jnp.maximum(cu[1:] - 1, 0)]  # each prompt's last token
        yd, pool = K.decode(
            params, cfg, dx.astype(params.dtype), pool, slots=dslots, backend=backend
        )
        return _next_input(last), _next_input(yd), pool

    return step


def _prompt(req: Request, cfg: K.KdaConfig, bucket: int) -> np.ndarray:
    x = np.zeros((bucket, cfg.hidden), np.float32)
    rng = np.random.default_rng(1000 + req.seed)
    x[: req.prompt_len] = rng.standard_normal((req.prompt_len, cfg.hidden))
    return x


def serve(params, cfg, eng: EngineConfig, trace: list[Request], backend=None, progress=True):
    """Runs the trace to the end. Returns a dict: tokens/s, per-token latency percentiles (the
    step time each decoded token waited), steps, and `check`, the relative error of one retired
    sequence's pool state against a prefill of all its inputs."""
    dtype = params.dtype
    step = make_step(cfg, backend)
    pool = K.KdaState.zeros(cfg, eng.slots)
    free = list(range(eng.slots))
    waiting = list(trace)
    running: dict[int, dict] = {}  # slot -> request, inputs so far, tokens left, next input
    retired: list[dict] = []
    a, m, d = eng.max_prompts, eng.max_decode, cfg.hidden
    latencies, n_tokens, n_steps = [], 0, 0

    def run(pool, admits, rows):
        px = np.zeros((a * eng.bucket, d), np.float32)
        plen, pslots = np.zeros(a, np.int32), np.full(a, -1, np.int32)
        at = 0
        for i, (slot, req) in enumerate(admits):
            n = req.prompt_len
            px[at : at + n] = _prompt(req, cfg, eng.bucket)[:n]
            plen[i], pslots[i] = n, slot
            at += n
        cu = np.concatenate([[0], np.cumsum(plen)]).astype(np.int32)
        dx, dslots = np.zeros((m, d), np.float32), np.full(m, -1, np.int32)
        for i, slot in enumerate(rows):
            dx[i], dslots[i] = running[slot]["next"], slot
        return step(
            params, pool, jnp.asarray(px, dtype), jnp.asarray(cu), jnp.asarray(pslots),
            jnp.asarray(dx), jnp.asarray(dslots),
        )  # fmt: skip

    # Compile (and warm up) on an all-padding step: no slot is written.
    *_, pool = jax.block_until_ready(run(pool, [], []))
    t_start = time.perf_counter()
    tick = 0
    while waiting or running:
        admits = []
        while waiting and waiting[0].arrival <= tick and free and len(admits) < a:
            admits.append((free.pop(0), waiting.pop(0)))
        rows = sorted(running)[:m]  # the rest wait a step (none when max_decode >= slots)
        t0 = time.perf_counter()
        nxt_p, nxt_d, pool = run(pool, admits, rows)
        nxt_p, nxt_d = np.asarray(nxt_p), np.asarray(nxt_d)  # waits for the step
        dt = time.perf_counter() - t0
        n_steps += 1
        for i, slot in enumerate(rows):
            seq = running[slot]
            seq["inputs"].append(seq["next"])
            seq["left"] -= 1
            seq["next"] = nxt_d[i]
            latencies.append(dt)
            n_tokens += 1
            if seq["left"] == 0:
                state = jax.tree.map(lambda x, s=slot: np.asarray(x[s]), pool)
                retired.append(dict(seq, state=state))
                del running[slot]
                free.append(slot)
        for i, (slot, req) in enumerate(admits):
            prompt = _prompt(req, cfg, eng.bucket)[: req.prompt_len]
            running[slot] = dict(req=req, inputs=list(prompt), left=req.gen_len, next=nxt_p[i])
            n_tokens += req.prompt_len
        tick += 1
        if progress:
            done = len(trace) - len(waiting) - len(running)
            bar = "#" * (30 * done // max(1, len(trace)))
            print(
                f"\r[{bar:<30}] {done}/{len(trace)} requests, step {tick}", end="", file=sys.stderr
            )
    elapsed = time.perf_counter() - t_start
    if progress:
        print(file=sys.stderr)
    lat = np.asarray(latencies) * 1e3
    return dict(
        steps=n_steps,
        tokens=n_tokens,
        tokens_per_s=n_tokens / elapsed,
        latency_ms={p: float(np.percentile(lat, p)) for p in (50, 90, 99)} if len(lat) else {},
        check=_check(params, cfg, retired[0], backend) if retired else None,
    )


def _check(params, cfg, seq: dict, backend) -> float:
    """Relative RMS error of a retired sequence's pool state (recurrent) against one prefill of
    all its inputs from a fresh state."""
    x = jnp.asarray(np.stack(seq["inputs"])[None], params.dtype)
    _, want = K.prefill(params, cfg, x, K.KdaState.zeros(cfg, 1), backend=backend)
    got, ref = seq["state"].recurrent, np.asarray(want.recurrent[0])
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="config preset (default: tiny on a CPU)")
    parser.add_argument("--backend", default=None, choices=["xla", "pallas"])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20, help="steps over which requests arrive")
    parser.add_argument("--max-gen", type=int, default=12)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--bucket", type=int, default=48)
    parser.add_argument("--max-prompts", type=int, default=2)
    parser.add_argument("--max-decode", type=int, default=8)
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    cfg = K.preset(args.preset or ("kimi-linear-48b" if gpu else "tiny"))
    dtype = jnp.bfloat16 if gpu else jnp.float32
    params = K.init_params(cfg, jax.random.key(0), dtype)
    eng = EngineConfig(args.slots, args.max_prompts, args.bucket, args.max_decode)
    trace = make_trace(args.requests, args.steps, args.bucket, args.max_gen)
    res = serve(params, cfg, eng, trace, backend=args.backend)
    lat = ", ".join(f"p{p} {v:.2f} ms" for p, v in res["latency_ms"].items())
    print(
        f"{len(trace)} requests, {res['tokens']} tokens in {res['steps']} steps: "
        f"{res['tokens_per_s']:,.0f} tokens/s; per decoded token {lat}"
    )
    bar = 1e-2 if dtype == jnp.bfloat16 else 1e-3  # README's bars: bf16 e2e; fp32 chunked/TF32
    print(f"check: a retired sequence's pooled state vs one prefill, rel. error {res['check']:.1e}")
    if not res["check"] < bar:
        print(f"serve: check failed, {res['check']:.1e} >= {bar:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
