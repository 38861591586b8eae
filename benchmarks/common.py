"""Shared by the benchmark scripts: run metadata, and the record writer that keeps
`benchmarks/results/<bench>.json` at the newest figure of every (bench, shape, backend)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def command() -> str:
    """This run's command line with repo-relative paths (machine paths reduced to a file name)."""

    def rel(arg: str) -> str:
        key, eq, value = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
        if not os.path.isabs(value):
            return arg
        path = Path(value).resolve()
        try:
            value = path.relative_to(ROOT).as_posix()
        except ValueError:
            value = path.name
        return f"{key}{eq}{value}"

    return " ".join(["python", *(rel(a) for a in sys.argv)])


def meta() -> dict:
    """date, commit (KDA_COMMIT, else git), device and the command of this run."""
    commit = os.environ.get("KDA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=commit,
        device=jax.devices()[0].device_kind,
        command=command(),
    )


# Measured device-to-device copy bandwidth (bytes read + written per second) of the GPUs the
# benchmarks run on: the byte floors are taken at the bandwidth of the device that ran them.
COPY_BANDWIDTH = {"H100": 3.0e12, "H200": 4.3e12}


def bandwidth() -> float:
    """B/s for byte floors: the copy bandwidth of this process's GPU (`COPY_BANDWIDTH`); the
    H200's elsewhere (a CPU run times nothing against it)."""
    kind = jax.devices()[0].device_kind
    return next((bw for name, bw in COPY_BANDWIDTH.items() if name in kind), COPY_BANDWIDTH["H200"])


def record_key(rec: dict) -> tuple[str, str, str]:
    """What a newer record replaces: the same bench, shape and backend."""
    return rec["bench"], str(rec["shape"]), rec["backend"]


def merge_results(records: list[dict], results_dir: str | os.PathLike = RESULTS) -> list[Path]:
    """Writes each record into `results_dir/<bench>.json` (a JSON list), replacing a record of
    the same bench, shape and backend and keeping the others. A failed record (time_us null)
    replaces nothing: it is skipped with a line on stderr. Returns the files written."""
    written = []
    for bench in dict.fromkeys(r["bench"] for r in records):
        new = [r for r in records if r["bench"] == bench and r.get("time_us") is not None]
        for r in records:
            if r["bench"] == bench and r.get("time_us") is None:
                print(f"not saved (failed): {' '.join(record_key(r))}", file=sys.stderr)
        if not new:
            continue
        path = Path(results_dir) / f"{bench}.json"
        old = json.loads(path.read_text()) if path.exists() else []
        keys = {record_key(r) for r in new}
        kept = [r for r in old if record_key(r) not in keys]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept + new, indent=1) + "\n")
        written.append(path)
    return written


# How SPEC §9 called FLA 0.6.0 (L2, gate and beta in its kernels, initial and final state).
FLA_OPTIONS = dict(
    output_final_state=True,
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=True,
    use_beta_sigmoid_in_kernel=True,
)


FLA_LAYER_NAME = "fla-0.6.0 KimiDeltaAttention"


def fla_layer(cfg, lower_bound):
    """FLA 0.6.0's own block, `fla.layers.kda.KimiDeltaAttention`, built on cfg's geometry as
    SPEC §9 describes (bf16, eval mode; `safe_gate` with the bounded gate). Raises if fla is
    missing."""
    import torch
    from fla.layers.kda import KimiDeltaAttention

    extra = {} if lower_bound is None else dict(lower_bound=lower_bound, safe_gate=True)
    layer = KimiDeltaAttention(
        hidden_size=cfg.hidden,
        num_heads=cfg.heads,
        head_dim=cfg.head_dim,
        conv_size=cfg.conv_kernel,
        layer_idx=0,
        **extra,
    )
    return layer.cuda().to(torch.bfloat16).eval()


def fla_layer_prefill_us(layer, b: int, t: int, reps: int = 7, calls: int = 10) -> dict:
    """µs per `layer(x)` call, x [B, T, D] bf16 random, no gradients: `eager` (`calls`
    back-to-back calls between CUDA events, median of `reps`) and `graph` (the same calls
    replayed as one CUDA graph)."""

    import torch

    x = torch.randn(b, t, layer.hidden_size, device="cuda", dtype=torch.bfloat16)

    def call():
        return layer(x)

    with torch.inference_mode():
        for _ in range(3):
            call()
        torch.cuda.synchronize()

        def eager_calls():
            for _ in range(calls):
                call()

        eager = _event_us(eager_calls, reps) / calls
    graph = cuda_graph_us(call, reps, calls)
    return dict(eager=round(eager, 2), graph=round(graph, 2))


class _StateCache:
    """The cache object FLA's layer reads and writes in decode (SPEC §10: `__len__`,
    `__getitem__`, `update`). `update` copies the new states into the tensors it already holds,
    so the replays of a captured CUDA graph read and write one set of buffers."""

    def __init__(self):
        self.layers = []

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def update(self, layer_idx, recurrent_state=None, conv_state=None, offset=1, **_):
        new = dict(recurrent_state=recurrent_state, conv_state=conv_state)
        if layer_idx < len(self.layers):
            old = self.layers[layer_idx]
            for key, value in new.items():
                for dst, src in zip(_tensors(old[key]), _tensors(value), strict=True):
                    if dst is not src:
                        dst.copy_(src)
        else:
            self.layers.append(new)
        return self.layers[layer_idx]


def _tensors(state) -> tuple:
    """A state entry (a tensor, a tuple of them, or None) as a tuple of tensors."""
    if state is None:
        return ()
    return tuple(state) if isinstance(state, tuple | list) else (state,)


def fla_layer_decode_us(layer, b: int, reps: int = 7, calls: int = 20, prime: int = 16) -> dict:
    """µs per decode step of FLA's layer, `layer(x[B, 1, D], past_key_values=cache,
    use_cache=True)` (its fused_recurrent path), after a `prime`-token call filled the cache
    (SPEC §10): `eager` (`calls` steps between CUDA events, median of `reps`) and `graph` (the
    same steps replayed as one CUDA graph)."""
    import torch

    d = layer.hidden_size
    x0 = torch.randn(b, prime, d, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(b, 1, d, device="cuda", dtype=torch.bfloat16)
    cache = _StateCache()

    def call():
        return layer(x, past_key_values=cache, use_cache=True)

    with torch.inference_mode():
        layer(x0, past_key_values=cache, use_cache=True)
        for _ in range(3):
            call()
        torch.cuda.synchronize()

        def eager_calls():
            for _ in range(calls):
                call()

        eager = _event_us(eager_calls, reps) / calls
    graph = cuda_graph_us(call, reps, calls)
    return dict(eager=round(eager, 2), graph=round(graph, 2))


class Records(list):
    """A list of result records that is saved and printed on every append, so a run cut short
    by a time limit still leaves every finished case on disk.

    out: None merges each record into `benchmarks/results/<bench>.json` (`merge_results`);
    a path rewrites that file with this run's list instead."""

    def __init__(self, out: str | os.PathLike | None = None):
        super().__init__()
        self.path = None if out is None else Path(out)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, rec: dict) -> None:
        super().append(rec)
        if self.path is None:
            merge_results([rec])
        else:
            self.path.write_text(json.dumps(list(self), indent=1))
        t, base = rec.get("time_us"), rec.get("baseline")
        base_s = "" if not base else f"  | {base['name']}: {base['time_us']} us"
        print(
            f"{rec['bench']:<14}{rec['shape']:<36}{rec['backend']:<26}"
            f"{'FAILED' if t is None else f'{t:.1f} us':>12}  floor {rec['floor_us']}{base_s}",
            flush=True,
        )

    def where(self) -> str:
        """Where the records went, for the run's last line."""
        if self.path is not None:
            return str(self.path)
        benches = dict.fromkeys(r["bench"] for r in self)
        return ", ".join(f"benchmarks/results/{b}.json" for b in benches)


def cuda_graph_us(call, reps: int, calls: int = 20) -> float:
    """Median us per call of a PyTorch callable: `calls` calls captured in one CUDA graph,
    replayed `reps` times under torch.inference_mode() (how SPEC §9 timed FLA). Warm-up (and
    Triton autotuning) runs on a side stream before capture."""

    import torch

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of JAX's runtime threads in this process neither invalidate
        # the capture nor fail (under the default global mode a failed FLA capture left JAX's
        # stream in an error state and every later case of the run failed, 2026-12-01).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(calls):
                call()
        graph.replay()
        torch.cuda.synchronize()
        us = _event_us(graph.replay, reps) / calls
    del graph
    torch.cuda.empty_cache()
    return us


def _event_us(run, reps: int) -> float:
    """Median µs of `run()` between two CUDA events, over `reps` runs."""
    import statistics

    import torch

    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def torch_kernels(call, calls: int = 10) -> list[tuple[str, float, float]]:
    """(kernel name, device us per call, launches per call) of a PyTorch callable under
    torch.profiler (CUPTI), after three warm-up calls (Triton autotuning), slowest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows.append((ev.key[:70], round(t / calls, 2), ev.count / calls))
    return sorted(rows, key=lambda r: -r[1])


def time_loop(
    step, carry, n: int, reps: int, unroll: int | bool = 1, differential=False, consts=None
) -> float:
    """Median us per step of `carry = step(carry)` run n times in one jitted `fori_loop` (carry
    donated), after a compile and a warm-up call. `unroll=True` writes the n steps out as
    straight-line code (on the H200 that measured slower than the rolled loop:
    docs/performance.md).

    differential: also time a loop of 3n steps and return (T(3n) - T(n)) / 2n, which cancels
    what every call costs once (dispatch, donation, the final sync: ~0.2-0.4 ms on the H200,
    10+ us per step of a 16-step loop); for steps of a few to tens of us (decode).

    consts: inputs every step reads and none changes, passed as `step(consts, carry)` through
    an argument of the jitted loop (not donated); large arrays closed over instead would be
    lowered as constants into the program (slow to compile, gigabytes at bench sizes)."""
    import statistics
    import time

    from jax import lax

    def per_call(steps, carry):
        body = (lambda c, k: step(c)) if consts is None else (lambda c, k: step(k, c))
        loop = jax.jit(
            lambda c, k: lax.fori_loop(0, steps, lambda i, c: body(c, k), c, unroll=unroll),
            donate_argnums=0,
        )
        for _ in range(2):
            carry = jax.block_until_ready(loop(carry, consts))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            carry = jax.block_until_ready(loop(carry, consts))
            times.append(time.perf_counter() - t0)
        return statistics.median(times), carry

    t1, carry = per_call(n, carry)
    if not differential:
        return t1 / n * 1e6
    t3, _ = per_call(3 * n, carry)
    return (t3 - t1) / (2 * n) * 1e6


def run_case(records, meta, bench, shape, backend, run, floor, base_us, base_name, **extra):
    """Runs one case and appends its record; returns µs per call, or None when it failed (the
    record then holds time_us null and the error). `fraction` = floor / time."""
    rec = dict(bench=bench, shape=shape, backend=backend, floor_us=round(floor, 2))
    t = None
    try:
        t = run()
        rec.update(time_us=round(t, 2), fraction=round(floor / t, 3))
    except Exception as e:  # noqa: BLE001 - reported, never hidden
        rec.update(time_us=None, fraction=None, error=f"{type(e).__name__}: {e}"[:400])
        print(f"[{bench} {shape} {backend}] failed: {rec['error']}", file=sys.stderr)
    rec["baseline"] = None if base_us is None else dict(name=base_name, time_us=round(base_us, 2))
    rec.update({k: (v(t) if callable(v) else v) for k, v in extra.items()} if t else {})
    rec.update(meta)
    records.append(rec)
    return t
