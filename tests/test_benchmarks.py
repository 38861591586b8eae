"""The GPU benchmark scripts import and parse their arguments on any machine (they run on a GPU
only, so nothing else would notice a stale option before a GPU job does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TOL, assert_close

from pallas_kernels.chunk_prepare import PrepareBlockSizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [
    "bench_decode",
    "bench_gemv",
    "bench_packed",
    "bench_prefill",
    "bench_sharding",
    "block_profile",
    "decode_profile",
    "stage_profile",
]


@pytest.mark.parametrize(
    "name", [SCRIPTS[0], *(pytest.param(n, marks=pytest.mark.slow) for n in SCRIPTS[1:])]
)
def test_script_help(name):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--out" in out.stdout


def test_bench_decode_pool_case_runs_on_the_cpu(rng):
    """The pool case's step (tiny geometry, xla backend) updates only the named slots."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_decode
    import jax
    import numpy as np

    from kda_jax import init_params, preset

    cfg = preset("tiny")
    params = init_params(cfg, rng)
    for k in (0, 2):
        step, (x, pool), floor = bench_decode.pool_case(cfg, params, 3, rng, k=k, backend="xla")
        y, new = step((x, pool))
        assert y.shape == x.shape and floor > 0
        changed = np.flatnonzero(np.any(np.asarray(new.recurrent != pool.recurrent), (1, 2, 3)))
        assert len(changed) == 3 and new.recurrent.shape[0] == 6
        jax.block_until_ready(new)


def test_bench_packed_inputs_and_steps_run_on_the_cpu(rng):
    """The packed bench's prompts come to about 64k tokens within [64, 8192]; at a small size
    (H = 2, K = 32, interpret mode) its packed step on the chunk-aligned stream and its padded
    step give the same final states, so both figures time the same work."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_packed
    import jax

    for n in (16, 64):
        lengths = bench_packed.draw_lengths(n, seed=n)
        assert len(lengths) == n and lengths.min() >= 64 and lengths.max() <= 8192
        assert abs(int(lengths.sum()) - 65536) < 0.02 * 65536
    lengths = bench_packed.draw_lengths(3, seed=0, total=90, lo=5, hi=60)
    fla, ours, cu, holds = bench_packed.packed_inputs(lengths, 2, 32, 16, rng)
    assert int(holds.sum()) == int(lengths.sum()) == int(cu[-1])
    padded, lens = bench_packed.padded_inputs(fla, cu)
    for lb in (None, bench_packed.LB):
        got = bench_packed.packed_step(ours, fla[-1], lower_bound=lb, chunk=16)
        want = bench_packed.padded_step((padded, lens), fla[-1], lower_bound=lb, chunk=16)
        assert_close(got, want, TOL["bf16_stage"], f"final states, lower_bound={lb}")
        jax.block_until_ready(got)


def test_stage_profile_configs_build_block_sizes():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import stage_profile

    assert stage_profile.prepare_block_sizes("default") == PrepareBlockSizes()
    blk = stage_profile.prepare_block_sizes("block_k=32+num_warps=8+wu_stages=2")
    assert (blk.block_k, blk.num_warps, blk.wu_stages) == (32, 8, 2)
    assert blk.wu_block_k == PrepareBlockSizes().wu_block_k
    for bad in ("32x8", "split=1", "num_stages=two"):
        with pytest.raises(ValueError, match="bad --configs entry"):
            stage_profile.prepare_block_sizes(bad)


def test_decode_profile_core_records_carry_the_table_keys():
    """A core:B record gets the results table's keys from its own figures (busy per step, FLA's
    busy per call); a record saved before the shape named the warps claims none."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import decode_profile

    from kda_jax.config import preset

    cfg = preset("kimi-linear-48b")
    rec = dict(bench="core_profile", shape="B=8,block_v=32,warps=4", busy_us=9.1, fla_busy_us=11.3)
    keys = decode_profile.table_keys(rec, cfg)
    assert keys["bench"] == "decode_core_device"
    assert keys["shape"] == "B=8,H=32,K=128,R=1"
    assert keys["backend"] == "pallas[block_v=32,warps=4]"
    assert keys["time_us"] == 9.1
    assert keys["baseline"]["time_us"] == 11.3
    # The fp32 state of 8 x 32 heads read and written is 33.5 MB, 7.8 us at 4.3 TB/s.
    lo, hi = TOL["decode_floor_us"]
    assert lo < keys["floor_us"] < hi
    old = dict(rec, shape="B=8,block_v=32", fla_busy_us=None)
    keys = decode_profile.table_keys(old, cfg)
    assert keys["backend"] == "pallas[block_v=32]" and keys["baseline"] is None


def _results_module():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_results_table

    return make_results_table


def test_results_records_are_current_and_relative():
    """benchmarks/results/<bench>.json: one file per bench, one record per (shape, backend), every
    key the table needs, a figure, and a command that names repo paths only."""
    mrt = _results_module()
    records = mrt.load_records(os.path.join(ROOT, "benchmarks", "results"))
    assert records, "no benchmark records"
    keys = set()
    for r in records:
        assert r["_file"] == f"{r['bench']}.json", r["_file"]
        key = (r["bench"], mrt.shape_str(r["shape"]), r["backend"])
        assert key not in keys, f"two records for {key}"
        keys.add(key)
        assert r["time_us"] is not None, key
        assert r["command"].startswith("python benchmarks/"), r["command"]
        for bad in ("/root", "/work", "/tmp", "$OUT", "wip/", "history/", ".patch"):
            assert bad not in r["command"] + str(r.get("note", "")), (key, bad)


def test_results_tables_match_the_records():
    """The README's and docs/performance.md's tables are what make_results_table renders."""
    mrt = _results_module()
    assert mrt.main(["--check"]) == 0, "run: python scripts/make_results_table.py"


def test_merge_results_replaces_the_same_case_only(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import common

    a = dict(bench="b", shape="B=1", backend="pallas", time_us=2.0)
    b = dict(bench="b", shape="B=8", backend="pallas", time_us=5.0)
    common.merge_results([a, b], tmp_path)
    common.merge_results([dict(a, time_us=1.5), dict(b, time_us=None)], tmp_path)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert {r["shape"]: r["time_us"] for r in saved} == {"B=1": 1.5, "B=8": 5.0}
