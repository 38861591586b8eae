"""The main job (`kda-jax` / `python -m kda_jax`)."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

import kda_jax as K
from kda_jax.cli import main


def test_default_run_passes_and_prints_table(capsys):
    assert main(["--prompt", "40", "--decode", "5", "--verify", "3"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "prefill final_out",
        "decode final_out",
        "verify final_out",
        "rel err",
        "all stages within the bar",
    ):
        assert needle in out


def test_fp32_bounded_from_checkpoint(tmp_path, capsys):
    cfg = K.preset("tiny-bounded")
    K.save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)), layer_idx=0)
    rc = main(
        [
            "--checkpoint",
            str(tmp_path),
            "--layer",
            "0",
            "--dtype",
            "fp32",
            "--prompt",
            "70",
            "--decode",
            "3",
            "--verify",
            "2",
            "--batch",
            "1",
        ]
    )
    assert rc == 0
    assert "gate=bounded" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--batch", "0"], "--batch=0 must be >= 1"),
        (["--verify", "9"], "--verify=9 exceeds max_verify=8"),
        (["--checkpoint", "/nonexistent"], "--checkpoint needs --layer"),
        (["--checkpoint", "/nonexistent", "--layer", "0"], "no config.json"),
        (["--layer", "3"], "--layer only applies with --checkpoint"),
        (["--backend", "cuda"], "invalid choice"),
        (["--prompt", "x"], "invalid int value"),
    ],
)
def test_bad_arguments_one_clear_line(args, pattern):
    r = subprocess.run(
        [sys.executable, "-m", "kda_jax", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if "Warning" not in ln]
    assert len(lines) == 1 and pattern in lines[0] and "Traceback" not in r.stderr, r.stderr
