"""Registers, spills and shared memory of the Triton kernels as ptxas builds them for an H200,
on any machine (no GPU): the number that decided chunk_prepare's speed (docs/performance.md).

    make setup EXTRAS=test,notebooks,ptxas
    .venv/bin/python scripts/ptxas_report.py [prepare-bounded prepare-unbounded scan ...]

How: each case is cross-lowered for the H200 (as tests/conftest.lower_for_h200 does) with
`pallas_call(debug=True)`, which prints every kernel's Triton module; the printed module is
stripped of its source locations, compiled by the triton package (3.6, the H200 image's) for
sm_90a with the kernel's num_warps / num_stages, and the PTX is handed to that package's ptxas
with -v. Numbers are per kernel; 65536 / (registers x 32 x num_warps) programs fit on an SM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from conftest import lower_for_h200  # noqa: E402

from kda_jax import forward  # noqa: E402
from kda_jax.config import DEFAULT_CHUNK, preset  # noqa: E402
from kda_jax.params import init_params  # noqa: E402
from kda_jax.state import KdaState  # noqa: E402
from pallas_kernels.chunk_prepare import ChunkIntermediates, chunk_prepare  # noqa: E402
from pallas_kernels.chunk_scan import chunk_scan  # noqa: E402
from pallas_kernels.chunk_vjp import chunk_kda_vjp  # noqa: E402
from pallas_kernels.conv import conv_prefill  # noqa: E402

BF16 = jnp.bfloat16
# Kimi-Linear head geometry at the default chunk width; a few chunks are enough for the code
# ptxas sees (B = 1: the scan's tiling for one sequence, ScanBlockSizes.get_default).
B, T, H, K, C = 1, 128, 32, 128, DEFAULT_CHUNK


def _prepare(lower_bound):
    zeros = jnp.zeros((B, T, H, K), BF16)

    def fn(q, f, beta):
        return chunk_prepare(
            q, q, q, f, beta, jnp.full((B,), T, jnp.int32), jnp.zeros((H,)),
            jnp.zeros((H * K,)), scale=K**-0.5, chunk=C, lower_bound=lower_bound,
            mm_dtype=BF16, l2_eps=1e-6, interpret=False,
        )  # fmt: skip

    return fn, (zeros, jnp.zeros((B, T, H * K), BF16), jnp.zeros((B, T, H), BF16))


def _scan():
    n = T // C
    inter = ChunkIntermediates(
        qg=jnp.zeros((B, H, T, K), BF16),
        kg=jnp.zeros((B, H, T, K), BF16),
        w=jnp.zeros((B, H, T, K), BF16),
        u=jnp.zeros((B, H, T, K), jnp.float32),
        a=jnp.zeros((B, H, T, C), BF16),
        gl=jnp.zeros((B, H, n, K), jnp.float32),
    )
    fn = lambda i, s: chunk_scan(i, s, t=T, out_dtype=BF16, interpret=False)  # noqa: E731
    return fn, (inter, jnp.zeros((B, H, K, K)))


def _conv_prefill():
    """The block's conv_prefill (q|k|v of the Kimi-Linear preset, bf16 in and out)."""
    c = 3 * H * K
    x = jnp.zeros((B, T, c), BF16)
    fn = lambda x, s, w, n: conv_prefill(  # noqa: E731
        x, s, w, n, qk_channels=2 * H * K, head_dim=K, l2_eps=1e-6, out_dtype=BF16,
        splits=(H * K,) * 3, interpret=False,
    )  # fmt: skip
    return fn, (x, jnp.zeros((B, 3, c)), jnp.zeros((c, 4)), jnp.full((B,), T, jnp.int32))


def _train_core():
    """The training path's chunked core, forward and backward (every `chunk_vjp` kernel)."""
    a = jnp.zeros((B, T, H, K))

    def fn(q, g, beta, s):
        def loss(q, g, beta, s):
            o, st = chunk_kda_vjp(q, q, q, g, beta, s, scale=K**-0.5, chunk=C, interpret=False)
            return jnp.sum(o) + jnp.sum(st)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, g, beta, s)

    return fn, (a, a, jnp.zeros((B, T, H)), jnp.zeros((B, H, K, K)))


def _decode(batch, rows=None):
    """The whole block's decode step (every decode kernel), Kimi-Linear preset, bf16 weights; with
    `rows`, the verify step (decode_k) of that many rows instead."""
    cfg = preset("kimi-linear-48b")
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), BF16))
    state = KdaState(
        recurrent=jax.ShapeDtypeStruct(cfg.recurrent_state_shape(batch), jnp.float32),
        conv=jax.ShapeDtypeStruct(cfg.conv_state_shape(batch), jnp.float32),
    )
    step = forward.decode if rows is None else forward.decode_k
    x = jax.ShapeDtypeStruct(
        (batch, cfg.hidden) if rows is None else (batch, rows, cfg.hidden), BF16
    )
    fn = lambda p, x, s: step(p, cfg, x, s, backend="pallas", interpret=False)  # noqa: E731
    return fn, (params, x, state)


CASES = {
    "prepare-bounded": lambda: _prepare(-5.0),
    "prepare-unbounded": lambda: _prepare(None),
    "scan": _scan,
    "conv-prefill": _conv_prefill,
    "train-core": _train_core,
    "decode-b1": lambda: _decode(1),
    "decode-b64": lambda: _decode(64),
    "verify-k8": lambda: _decode(1, rows=8),
}


def triton_modules(fn, args) -> list[tuple[str, str, int, int]]:
    """(kernel name, Triton module text, num_warps, num_stages) of every pallas_call in fn."""
    original = pl.pallas_call

    def debug_call(*a, **kw):
        return original(*a, **{**kw, "debug": True})

    out = io.StringIO()
    pl.pallas_call = debug_call
    try:
        with contextlib.redirect_stdout(out):
            hlo = lower_for_h200(fn, *args)
    finally:
        pl.pallas_call = original
    # Launch parameters (name, num_warps, num_stages) of every launch in the HLO.
    params = [
        (m.group(1), int(m.group(3)), int(m.group(2)))
        for m in re.finditer(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+)', hlo)
    ]
    parts = out.getvalue().split("module for pallas_call ")[1:]
    names = [part.split()[0] for part in parts]
    if sorted(p[0] for p in params) != sorted(names):
        raise RuntimeError(f"ptxas_report: kernels {names} do not match launches {params}")
    # The HLO may list a nested function's launches after the caller's: match by name, in order.
    modules = []
    for part, name in zip(parts, names, strict=True):
        i = next(i for i, p in enumerate(params) if p[0] == name)
        _, w, st = params.pop(i)
        modules.append((name, _clean(part), w, st))
    return modules


def _clean(printed: str) -> str:
    """The printed module without its pretty source locations (which MLIR cannot parse back)."""
    text = printed[printed.index("\n") + 1 :]
    lines = [ln for ln in text.split("\n") if not re.match(r"^(#loc|\s*at #loc\d+\s*$)", ln)]
    text = "\n".join(lines)
    for pattern in (
        r" \[unknown\]",
        r" at #loc\d+",
        r" #loc\d+",
        r" /\S+\.py(:\d+:\d+)?( to (\d+)?:\d+(:\d+)?)?",
        r' "[^"\n]*"\(#loc\d+\)',
        r' "[^"\n]*"\((?:[^()\n]|\([^()\n]*\))*\)(?=[,)])',
    ):
        text = re.sub(pattern, "", text)
    text = re.sub(r' "[^"\n]*"\((?:[^()\n]|\([^()\n]*\))*\)\s*$', "", text, flags=re.M)
    text = re.sub(r' "[^"\n]*"\s*$', "", text, flags=re.M)
    return text[: text.rindex("\n}") + 2]


def ptxas_stats(module: str, num_warps: int, num_stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as fh:
            fh.write(module)
        kernel = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages),
        )
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as fh:
            fh.write(kernel.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        res = subprocess.run(
            [ptxas, "-v", "-arch=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    fit = 65536 // (int(regs.group(1)) * 32 * num_warps) if regs else "?"
    return (
        f"{regs.group(1) if regs else '?'} registers, spills {spill.group(1)}/{spill.group(2)} "
        f"bytes (store/load), shared {kernel.metadata.shared} B, warps {num_warps}, "
        f"{fit} programs/SM by registers"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"any of {list(CASES)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        sys.exit(f"ptxas_report: unknown case(s) {sorted(unknown)}; expected some of {list(CASES)}")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("ptxas_report: needs the triton package (make setup EXTRAS=test,notebooks,ptxas)")
    jax.config.update("jax_platforms", "cpu")
    for case in args.cases or list(CASES):
        fn, fargs = CASES[case]()
        for name, module, warps, stages in triton_modules(fn, fargs):
            print(f"{case:<18} {name:<22} {ptxas_stats(module, warps, stages)}")


if __name__ == "__main__":
    main()
