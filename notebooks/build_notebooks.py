"""Writes the notebooks of this folder (nbformat v4, no outputs) from the cell sources below.

    .venv/bin/python notebooks/build_notebooks.py

Edit the cells here, not in the .ipynb files, then rebuild; `make notebooks`
(scripts/run_notebooks.py) executes the result. The notebooks import `kda_jax`,
`examples/recall.py` and `scripts/make_results_table.py`; they define no library code.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat import v4

HERE = Path(__file__).resolve().parent


def md(text: str):
    return v4.new_markdown_cell(text.strip())


def code(text: str):
    return v4.new_code_cell(text.strip())


SETUP = code(
    """
import dataclasses
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import kda_jax as K

rel = lambda got, ref: float(  # noqa: E731  relative RMS error (inf when got is not finite)
    np.linalg.norm(np.float64(got) - np.float64(ref)) / np.linalg.norm(np.float64(ref))
    if np.all(np.isfinite(np.asarray(got, np.float64))) else np.inf
)
print(f"jax {jax.__version__} on {jax.default_backend()}: {jax.devices()[0].device_kind}")
"""
)

# ----------------------------------------------------------------------------------------------
WALKTHROUGH = [
    md(
        """
# 01 · KDA walkthrough: from config to output, stage by stage

This notebook follows one Kimi Delta Attention block through its stages on the CPU with the
tiny preset, for both gate variants, and checks every stage against the fp32 token-by-token
oracle (`K.oracle_forward`). Sizes are small and seeds fixed so it runs in well under a minute.
"""
    ),
    SETUP,
    md(
        """
## 1. The config

A `KdaConfig` is a frozen dataclass (jit takes it as a static argument). The two gate variants
differ only in `gate_lower_bound`: `None` is Kimi-Linear's unbounded gate
`g = -exp(A_log) softplus(f + dt_bias)`; a number `lb` gives
`g = lb sigmoid(exp(A_log)(f + dt_bias))`.
"""
    ),
    code(
        """
cfgs = {"unbounded": K.preset("tiny"), "bounded": K.preset("tiny-bounded")}
cfg = cfgs["unbounded"]
for f in dataclasses.fields(cfg):
    print(f"{f.name:<17}", *(f"{getattr(c, f.name)!s:<10}" for c in cfgs.values()))
print(f"P = H*K = {cfg.qkv_dim}, conv channels 3P = {cfg.conv_dim}, "
      f"fused input rows = {cfg.in_proj_dim}")
big = K.preset("kimi-linear-48b")
print(f"kimi-linear-48b: weights {big.weight_bytes() / 1e6:.1f} MB (bf16), "
      f"state {big.state_bytes(1) / 1e6:.2f} MB per sequence (fp32)")
"""
    ),
    md(
        """
## 2. The weights

`K.init_params` draws weights at realistic scales in the fused layout the forward reads
(`w_in` stacks q | k | v | f_a | g_a | b, so a decode step sweeps one matrix). Checkpoints are
mapped onto the same layout by `K.load_hf_layer`.
"""
    ),
    code(
        """
params = {v: K.init_params(c, jax.random.key(0), jnp.float32) for v, c in cfgs.items()}
for name, shape in params["unbounded"].shapes(cfg).items():
    print(f"{name:<9} {str(shape):<12} {getattr(params['unbounded'], name).dtype}")
"""
    ),
    md(
        """
## 3. Run the oracle and the block on the same input

`K.prefill(..., return_stages=True)` returns the intermediates of the kernel path under the
oracle's names. The oracle walks the tokens one at a time in fp32 and records every stage.
"""
    ),
    code(
        """
B, T = 2, 200
x = jax.random.normal(jax.random.key(1), (B, T, cfg.hidden), jnp.float32)
runs = {}
for v, c in cfgs.items():
    s0 = K.KdaState.zeros(c, B)
    y, state, stages = K.prefill(params[v], c, x, s0, backend="xla", return_stages=True)
    y_ref, state_ref, ref = K.oracle_forward(params[v], c, x, s0)
    runs[v] = dict(y=y, state=state, stages=stages, y_ref=y_ref, state_ref=state_ref, ref=ref)
print("oracle stages:")
for name in K.STAGES:
    print(f"  {name:<11} {tuple(runs['unbounded']['ref'][name].shape)}")
"""
    ),
    md(
        """
## 4. The per-channel decay spectrum

Each key channel `d` of each head has its own per-token decay `exp(g)`. Its half-life
`ln 2 / -g` (in tokens) says how long that channel remembers. The spectrum below is the mean over
the tokens above, sorted per head: a spread from a few tokens to hundreds. `K.init_params`
aims both variants at the same spread of decays, so at these inputs their statistics nearly
coincide; they differ in how the gate responds to its input (last panel): the bounded gate
saturates at `lb` per token, the unbounded one decays without limit as `f + dt_bias` grows
(notebook 02 drives it there).
"""
    ),
    code(
        """
from pallas_kernels.reference import gate_reference

fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
for v, r in runs.items():
    g = np.asarray(r["ref"]["gate"])  # [B, T, H, K] log-decay
    for h in range(cfg.heads):
        half_life = np.sort(np.log(2) / -g[..., h, :].reshape(-1, cfg.head_dim).mean(0))
        axes[0].semilogy(half_life, label=f"{v}, head {h}")
    axes[1].hist(g.ravel(), bins=60, alpha=0.6, label=v, log=True)
    axes[2].plot(np.asarray(r["ref"]["beta"])[0, :, 0], label=f"{v} beta, head 0")
axes[0].set(title="half-life per key channel (sorted)", xlabel="channel", ylabel="tokens")
axes[1].set(title="distribution of g = log-decay per token", xlabel="g")
axes[2].set(title="write strength beta over time", xlabel="token")
u = jnp.linspace(-8, 12, 200)[:, None]  # f + dt_bias with dt_bias = 0, one head of width 1
for v, c in cfgs.items():
    g, _ = gate_reference(u, jnp.zeros((200, 1)), jnp.zeros(1), jnp.zeros(1), head_dim=1,
                          lower_bound=c.gate_lower_bound)
    axes[3].plot(u[:, 0], g[:, 0, 0], label=f"{v} (A_log = 0)")
axes[3].set(title="gate response g(f + dt_bias)", xlabel="f + dt_bias", ylabel="g")
for ax in axes:
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
"""
    ),
    md(
        """
## 5. Every stage against the oracle

Relative RMS error of each stage of the kernel path (backend `xla` here) against the oracle,
with fp32 weights (bar 1e-4 on a CPU) and bf16 weights and activations (bar 1e-2 end to end).
"""
    ),
    code(
        """
stage_names = ["qkv_proj", "q", "k", "v", "g_raw", "out_gate", "o_norm_out", "final_out"]
errors = {}
for v, c in cfgs.items():
    for dtype in (jnp.float32, jnp.bfloat16):
        p = params[v] if dtype == jnp.float32 else K.init_params(c, jax.random.key(0), dtype)
        xd = x.astype(dtype)
        s0 = K.KdaState.zeros(c, B)
        _, st, stages = K.prefill(p, c, xd, s0, backend="xla", return_stages=True)
        _, st_ref, ref = K.oracle_forward(p, c, xd, s0)
        got = {n: np.asarray(stages[n], np.float32).reshape(ref[n].shape) for n in stage_names}
        e = {n: rel(got[n], ref[n]) for n in stage_names}
        e["state"] = rel(st.recurrent, st_ref.recurrent)
        errors[(v, jnp.dtype(dtype).name)] = e

names = stage_names + ["state"]
fig, ax = plt.subplots(figsize=(12, 3.8))
w = 0.2
for i, (key, e) in enumerate(errors.items()):
    ax.bar(np.arange(len(names)) + (i - 1.5) * w, [e[n] for n in names], w, label=" ".join(key))
ax.axhline(1e-4, color="k", ls=":", lw=1)
ax.axhline(1e-2, color="k", ls="--", lw=1)
ax.set_yscale("log")
ax.set_xticks(np.arange(len(names)), names)
ax.set_ylabel("relative RMS error vs oracle")
ax.set_title("each stage vs the fp32 oracle (dotted: fp32 bar 1e-4, dashed: bf16 bar 1e-2)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for key, e in errors.items():
    bar = 1e-4 if key[1] == "float32" else 1e-2
    worst = max(e, key=e.get)
    print(f"{key}: worst stage {worst} {e[worst]:.1e} (bar {bar:.0e})")
    assert e[worst] < bar
"""
    ),
    md(
        """
## 6. The state over a long sequence

A delta-rule state does not grow without bound: each write replaces the value stored under a
key (`S += k (beta (v - S^T k))^T`), and the decay shrinks old rows. The curves below are the
norm of each head's state `S [K, V]` after every token of a 2048-token sequence, from a jitted
`lax.scan` of `K.decode` steps. The dots are `K.prefill` of the same sequence with `lengths`
cut at a few points (one compiled call: each row of the batch stops at its own length), so the
chunked prefill and the token-by-token decode land on the same states.
"""
    ),
    code(
        """
T_long = 2048
x_long = jax.random.normal(jax.random.key(2), (1, T_long, cfg.hidden), jnp.float32)
cuts = jnp.array([64, 256, 512, 1024, 1536, 2048])


def state_norms(p, c, xs):
    def step(s, xt):
        _, s = K.decode(p, c, xt, s, backend="xla")
        return s, jnp.linalg.norm(s.recurrent[0], axis=(-2, -1))  # [H]

    return jax.lax.scan(step, K.KdaState.zeros(c, 1), jnp.moveaxis(xs, 1, 0))


fig, axes = plt.subplots(1, 2, figsize=(13, 3.6), sharey=True)
for ax, (v, c) in zip(axes, cfgs.items()):
    t0 = time.perf_counter()
    final, norms = jax.jit(state_norms, static_argnums=1)(params[v], c, x_long)
    norms = np.asarray(norms)
    secs = time.perf_counter() - t0
    rows = jnp.broadcast_to(x_long, (len(cuts), T_long, cfg.hidden))
    _, st = K.prefill(params[v], c, rows, K.KdaState.zeros(c, len(cuts)), cuts, backend="xla")
    pre = np.linalg.norm(np.asarray(st.recurrent), axis=(-2, -1))  # [cuts, H]
    for h in range(cfg.heads):
        color = f"C{h}"
        ax.plot(np.arange(1, T_long + 1), norms[:, h], lw=0.8, color=color,
                label=f"decode, head {h}")
        ax.plot(cuts, pre[:, h], "o", ms=5, color=color, mec="k",
                label=f"prefill with lengths, head {h}")
    ax.set(title=f"{v} gate: ||S|| per head", xlabel="token")
    ax.legend(fontsize=7)
    err = rel(pre[-1], norms[-1])
    print(f"{v}: {T_long} decode steps in {secs:.1f} s (incl. compile); "
          f"final ||S|| {norms[-1]}, prefill vs decode rel. diff {err:.1e}")
    assert err < 1e-4
plt.tight_layout()
plt.show()
"""
    ),
    md(
        """
## 7. Decode and the speculative verify

`decode` takes one token; `decode_k` verifies `k` drafted tokens in one call and returns the
state after each of them, so accepting `a` tokens is `K.select_snapshot(snaps, a - 1)`.
"""
    ),
    code(
        """
c, p = cfgs["bounded"], params["bounded"]
s0 = K.KdaState.zeros(c, B)
_, s_ctx = K.prefill(p, c, x[:, :150], s0, backend="xla")
draft = x[:, 150:154]  # [B, 4, D]
y_k, s_k, snaps = K.decode_k(p, c, draft, s_ctx, backend="xla")

s = s_ctx
for i in range(4):
    y_i, s = K.decode(p, c, draft[:, i], s, backend="xla")
    print(f"row {i}: decode_k vs decode output rel. diff {rel(y_k[:, i], y_i):.1e}, "
          f"vs oracle {rel(y_k[:, i], runs['bounded']['y_ref'][:, 150 + i]):.1e}")
accepted = jnp.array([2, 4])
resumed = K.select_snapshot(snaps, accepted - 1)
_, expected = K.prefill(p, c, draft, s_ctx, accepted, backend="xla")
err = rel(resumed.recurrent, expected.recurrent)
print(f"resumed state vs prefill of the accepted tokens: {err:.1e}")
assert err < 1e-4
"""
    ),
]

# ----------------------------------------------------------------------------------------------
NUMERICS = [
    md(
        """
# 02 · Numerics: every backend against the oracle

Error of the block's output and final state against the fp32 token-by-token oracle, over
sequence length, decay strength, weight precision and chunk size. All on the CPU at the tiny
geometry. The `pallas` backend runs here in interpret mode (slow), so it is measured only at a
couple of short lengths, and only if its kernels run on this machine.
"""
    ),
    SETUP,
    code(
        """
cfgs = {"unbounded": K.preset("tiny"), "bounded": K.preset("tiny-bounded")}
B = 2
key = jax.random.key(0)


def with_decay(p, scale):
    # Multiplies exp(A_log) by `scale`: stronger (> 1) or weaker (< 1) decay on every channel.
    return p.replace(a_log=p.a_log + np.log(scale))


def errors(p, c, x, backend, chunk=None):
    c = c if chunk is None else c.replace(chunk=chunk)
    s0 = K.KdaState.zeros(c, x.shape[0])
    y, st = K.prefill(p, c, x, s0, backend=backend)
    y_ref, st_ref, _ = K.oracle_forward(p, c, x, s0)
    return rel(y, y_ref), rel(st.recurrent, st_ref.recurrent)
"""
    ),
    md(
        """
## Which backends run here

`xla` is the pure-jnp path (always available). `pallas` is the Pallas Triton kernels: compiled
on a GPU, interpret mode on a CPU. A tiny probe decides whether to include it below.
"""
    ),
    code(
        """
backends = ["xla"]
try:
    c = cfgs["unbounded"]
    p = K.init_params(c, key, jnp.float32)
    xp = jax.random.normal(jax.random.key(9), (1, 20, c.hidden))
    t0 = time.perf_counter()
    e_out, e_state = errors(p, c, xp, "pallas")
    print(f"pallas runs here: T=20 probe in {time.perf_counter() - t0:.1f} s, "
          f"output err {e_out:.1e}, state err {e_state:.1e}")
    backends.append("pallas")
except Exception as e:  # a missing or failing kernel must not stop the notebook
    print(f"NOTE: the pallas backend cannot run here ({type(e).__name__}: {str(e)[:200]}); "
          "only the xla backend is measured.")
PALLAS_LENGTHS = (16, 64) if jax.default_backend() == "cpu" else (16, 64, 256, 1024)
print("backends measured:", backends)
"""
    ),
    md(
        """
## Error over sequence length and decay strength (fp32 weights)

Decay strength scales `exp(A_log)`: ×0.1 is weak decay (long memory), ×100 drives the
unbounded gate to hundreds of nats per chunk, where a careless chunked algorithm overflows
(`exp` of a positive cumulative decay). Both gate variants; fp32 bar on a CPU: 1e-4.
"""
    ),
    code(
        """
lengths = [16, 64, 256, 1024]
strengths = [0.1, 1.0, 10.0, 100.0]
table = {}
t0 = time.perf_counter()
for v, c in cfgs.items():
    base = K.init_params(c, key, jnp.float32)
    for s in strengths:
        p = with_decay(base, s)
        for t in lengths:
            x = jax.random.normal(jax.random.fold_in(key, t), (B, t, c.hidden))
            for be in backends:
                if be == "pallas" and (t not in PALLAS_LENGTHS or s not in (1.0, 100.0)):
                    continue
                table[(v, s, t, be)] = errors(p, c, x, be)
print(f"{len(table)} cases in {time.perf_counter() - t0:.1f} s")

fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
for ax, v in zip(axes, cfgs):
    for s in strengths:
        for be, style in (("xla", "-o"), ("pallas", "--s")):
            pts = [(t, table[(v, s, t, be)][0]) for t in lengths if (v, s, t, be) in table]
            if pts:
                ax.loglog(*zip(*pts), style, label=f"{be}, decay ×{s:g}")
    ax.axhline(1e-4, color="k", ls=":", lw=1)
    ax.set(title=f"{v} gate: output error vs oracle (fp32)", xlabel="T (tokens)")
    ax.legend(fontsize=7)
axes[0].set_ylabel("relative RMS error")
plt.tight_layout()
plt.show()
worst = max(table, key=lambda k: max(table[k]))
print("worst case", worst, "output/state error", table[worst])
assert all(np.isfinite(e).all() for e in table.values()), "NaN or inf at some decay strength"
"""
    ),
    md(
        """
## bf16 drift over a long prompt

bf16 weights and activations, one 4096-token prompt, unbounded gate. The error of the output
against the fp32 oracle (fed the same bf16 weights and input) per 256-token window shows
whether rounding accumulates along the sequence; the state error is measured after growing
prefixes (one prefill call with `lengths`). The end-to-end bar is 1e-2.
"""
    ),
    code(
        """
c = cfgs["unbounded"]
T_long, win = 4096, 256
cuts = jnp.array([256, 1024, 2048, 3072, 4096])
x = jax.random.normal(jax.random.key(3), (1, T_long, c.hidden))
fig, axes = plt.subplots(1, 2, figsize=(13, 3.6))
for dtype in (jnp.float32, jnp.bfloat16):
    p = K.init_params(c, key, dtype)
    xd = x.astype(dtype)
    s0 = K.KdaState.zeros(c, 1)
    y, _ = K.prefill(p, c, xd, s0, backend="xla")
    y_ref, _, _ = K.oracle_forward(p, c, xd, s0)
    y, y_ref = np.asarray(y, np.float32)[0], np.asarray(y_ref)[0]
    per_win = [rel(y[i : i + win], y_ref[i : i + win]) for i in range(0, T_long, win)]
    rows = jnp.broadcast_to(xd, (len(cuts), T_long, c.hidden))
    _, st = K.prefill(p, c, rows, K.KdaState.zeros(c, len(cuts)), cuts, backend="xla")
    st_err = []
    for i, n in enumerate(np.asarray(cuts)):
        _, st_ref, _ = K.oracle_forward(p, c, xd[:, :n], s0)
        st_err.append(rel(st.recurrent[i], st_ref.recurrent[0]))
    name = jnp.dtype(dtype).name
    axes[0].semilogy(np.arange(0, T_long, win) + win / 2, per_win, "-o", ms=3, label=name)
    axes[1].semilogy(np.asarray(cuts), st_err, "-o", label=name)
    print(f"{name}: output error {rel(y, y_ref):.2e} overall, last window {per_win[-1]:.2e}; "
          f"state error after {T_long} tokens {st_err[-1]:.2e}")
    if dtype == jnp.bfloat16:
        assert max(per_win) < 1e-2 and max(st_err) < 1e-2
axes[0].set(title="output error per 256-token window", xlabel="position")
axes[1].set(title="state error after a prefix", xlabel="prefix length")
for ax in axes:
    ax.axhline(1e-2, color="k", ls="--", lw=1)
    ax.legend()
plt.tight_layout()
plt.show()
"""
    ),
    md(
        """
## Chunk size

The chunked prefill (SPEC §5) processes `C` tokens per step with dense `C × C` products; the
chunk width changes the arithmetic order, not the result. Error against the oracle (and CPU time
of the `xla` path, for scale only) for C = 16, 32, 64, with strong decay on the unbounded gate.
"""
    ),
    code(
        """
c0 = cfgs["unbounded"]
t = 1024
x = jax.random.normal(jax.random.key(4), (B, t, c0.hidden))
res = {}
for dtype in (jnp.float32, jnp.bfloat16):
    for s in (1.0, 100.0):
        p = with_decay(K.init_params(c0, key, dtype), s)
        for chunk in (16, 32, 64):
            c = c0.replace(chunk=chunk)
            e_out, e_state = errors(p, c, x.astype(dtype), "xla")
            args = (p, c, x.astype(dtype), K.KdaState.zeros(c, B))
            secs = []
            for _ in range(3):  # compiled by errors() already; best of 3 (a shared CPU is noisy)
                t0 = time.perf_counter()
                jax.block_until_ready(K.prefill(*args, backend="xla"))
                secs.append(time.perf_counter() - t0)
            res[(jnp.dtype(dtype).name, s, chunk)] = (e_out, e_state, min(secs))
print(f"{'dtype':<9}{'decay':>6}{'chunk':>6}{'out err':>10}{'state err':>11}{'cpu ms':>9}")
for (d, s, chunk), (eo, es, sec) in res.items():
    print(f"{d:<9}{s:>6g}{chunk:>6}{eo:>10.1e}{es:>11.1e}{sec * 1e3:>9.1f}")
fig, ax = plt.subplots(figsize=(7, 3.5))
for d in ("float32", "bfloat16"):
    for s in (1.0, 100.0):
        errs = [res[(d, s, ch)][0] for ch in (16, 32, 64)]
        ax.semilogy([16, 32, 64], errs, "-o", label=f"{d}, decay ×{s:g}")
ax.set(xlabel="chunk C", ylabel="output error vs oracle", xticks=[16, 32, 64])
ax.set_title(f"chunk size, T={t}")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
assert all(np.isfinite(v[:2]).all() for v in res.values())
"""
    ),
]

# ----------------------------------------------------------------------------------------------
PERFORMANCE = [
    md(
        """
# 03 · Performance: what the benchmarks measured

Reads `benchmarks/results/<bench>.json` (the newest record of each case, written by the
`benchmarks/bench_*.py` scripts on a GPU) and plots, per case, our time beside the bandwidth
floor and the peer (XLA or flash-linear-attention, timed in the same process). Figures from
different machines or days are not comparable; each plot says where and when its numbers were
taken. With no results yet, the notebook says so and stops there.
"""
    ),
    code(
        """
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT / "scripts"))
import make_results_table as mrt  # noqa: E402

results_dir = Path(os.environ.get("KDA_RESULTS_DIR", ROOT / "benchmarks" / "results"))
records = mrt.load_records(results_dir)
print(f"{len(records)} records in {results_dir}")
if not records:
    print("No benchmark results yet: run the benchmarks on a GPU first (see README, "
          "'GPU tests and benchmarks'). Nothing to plot.")
"""
    ),
    code(
        """
if records:
    display(Markdown(mrt.markdown_table(records)))
"""
    ),
    md("## The block and the cores against their peers: time, floor and peer"),
    code(
        """
if records:
    fig = mrt.plot_records(records)
    plt.show()
"""
    ),
    md(
        """
## Per benchmark: distance to the floor and speed-up over the baseline

`time / floor` is how far a case is from the bandwidth (or compute) floor: 1.0 is the floor.
`baseline / time` above 1 means faster than the baseline measured in the same job.
"""
    ),
    code(
        """
if records:
    benches = sorted({r["bench"] for r in records})
    fig, axes = plt.subplots(len(benches), 1, figsize=(10, 2.8 * len(benches)), squeeze=False)
    for ax, bench in zip(axes[:, 0], benches):
        rs = [r for r in records if r["bench"] == bench and r["time_us"]]  # failed: no bar
        labels = [f"{mrt.shape_str(r['shape'])}\\n{r['backend']}" for r in rs]
        floor_ratio = [r["time_us"] / r["floor_us"] if r["floor_us"] else np.nan for r in rs]
        base_us = [(r["baseline"] or {}).get("time_us") for r in rs]
        speedup = [b / r["time_us"] if b else np.nan for b, r in zip(base_us, rs)]
        xs = np.arange(len(rs))
        ax.bar(xs - 0.2, floor_ratio, 0.4, label="time / floor")
        ax.bar(xs + 0.2, speedup, 0.4, label="baseline / time")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_title(f"{bench} | {', '.join(sorted({r['device'] for r in rs}))} | "
                     f"{', '.join(sorted({str(r['date']) for r in rs}))}")
        ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
"""
    ),
]

# ----------------------------------------------------------------------------------------------
RECALL = [
    md(
        """
# 04 · A model that learns with the block: multi-query associative recall

`examples/recall.py` builds a 2-layer language model from `KimiDeltaAttention` blocks
(embedding, RMSNorm pre-norm, KDA, residual, MLP, tied head) and trains it with optax on MQAR:
16 key-value pairs, then the 16 keys again in a shuffled order; the loss counts only the
answers. Chance is 1/32. Training uses the `xla` backend (pure jnp, so `jax.grad` flows; the
Pallas kernels have no VJP) on the CPU, in about two minutes.
"""
    ),
    code(
        """
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT / "examples"))
import recall  # noqa: E402

cfg = recall.RecallConfig()
tokens, targets, mask = recall.make_batch(cfg, jax.random.key(0), 1)
n = cfg.num_pairs
print("context:", np.asarray(tokens[0, : 2 * n]))
print("queries:", np.asarray(tokens[0, 2 * n :]))
print("loss at:", np.nonzero(np.asarray(mask[0]))[0])
print(cfg)
"""
    ),
    md("## Train"),
    code(
        """
model, history = recall.train(cfg, eval_every=25)
steps = [h["step"] for h in history]
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.6))
ax0.plot(steps, [h["eval_acc"] for h in history], "-o", ms=3, label="held-out batch")
ax0.plot(steps, [h["train_acc"] for h in history], "-", alpha=0.6, label="training batch")
ax0.axhline(0.9, color="k", ls="--", lw=1)
ax0.axhline(1 / (cfg.vocab // 2), color="gray", ls=":", lw=1, label="chance")
ax0.set(xlabel="step", ylabel="answer accuracy", title="MQAR accuracy", ylim=(0, 1.02))
ax0.legend()
ax1.semilogy(steps, [h["loss"] for h in history])
ax1.set(xlabel="step", title="cross-entropy on the answers")
plt.tight_layout()
plt.show()
final = history[-1]["eval_acc"]
print(f"final held-out accuracy {final:.3f} after {history[-1]['step']} steps "
      f"({history[-1]['seconds']:.0f} s)")
assert final >= 0.9, f"MQAR accuracy {final:.3f} < 0.9"
"""
    ),
    md(
        """
## Generate: prefill, then a jitted decode loop carrying one state per layer

`recall.decode_logits` feeds a sequence one token at a time through `model.decode` inside a
`lax.scan` that carries a `KdaState` per layer; its logits must equal the prefill's.
`recall.answer_by_decoding` prefills the key-value context and then answers every query in a
`lax.fori_loop`, feeding the model's own answers back in.
"""
    ),
    code(
        """
tokens, targets, mask = recall.make_batch(cfg, jax.random.key(2024), 128)
prefill_logits, _ = model(tokens)
step_logits, _ = recall.decode_logits(model, tokens)
diff = float(jnp.max(jnp.abs(step_logits - prefill_logits)) / jnp.max(jnp.abs(prefill_logits)))
print(f"decode loop vs prefill logits: max |diff| / max |logit| = {diff:.1e}")
assert diff < 1e-4

answers = recall.answer_by_decoding(model, tokens)
truth = tokens[:, 2 * n + 1 :: 2]
free_acc = float(jnp.mean(answers == truth))
teacher_acc = float(jnp.sum((prefill_logits.argmax(-1) == targets) * mask) / jnp.sum(mask))
print(f"accuracy: teacher-forced prefill {teacher_acc:.3f}, free-running decode {free_acc:.3f}")
print("row 0 answers:", np.asarray(answers[0]))
print("row 0 truth:  ", np.asarray(truth[0]))
assert free_acc >= 0.9
"""
    ),
]

NOTEBOOKS = {
    "01_walkthrough.ipynb": WALKTHROUGH,
    "02_numerics.ipynb": NUMERICS,
    "03_performance.ipynb": PERFORMANCE,
    "04_associative_recall.ipynb": RECALL,
}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = v4.new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print(f"wrote notebooks/{name} ({len(cells)} cells)")


if __name__ == "__main__":
    main()
