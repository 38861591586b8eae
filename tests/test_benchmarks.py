"""The GPU benchmark scripts import and parse their arguments on any machine (they run on a GPU
only, so nothing else would notice a stale option before a GPU job does)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["bench_decode", "bench_gemv", "bench_prefill", "decode_profile", "stage_profile"]


@pytest.mark.parametrize("name", SCRIPTS)
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


def test_stage_profile_configs_build_block_sizes():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import stage_profile

    blk = stage_profile.prepare_block_sizes("32x8")
    assert (blk.block_k, blk.num_warps) == (32, 8)
    with pytest.raises(ValueError):
        stage_profile.prepare_block_sizes("16x4+split")
