"""The main job (`kda-jax` / `python -m kda_jax`): a run against the oracle, and one clear line
(exit status 2, no traceback, no work done) for every bad argument or checkpoint."""

from __future__ import annotations

import argparse
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kda_jax as K
from kda_jax import cli
from kda_jax.cli import main
from kda_jax.hf import PREFIX


@pytest.mark.slow
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


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a run starts any work (weights, oracle, forward)."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before every argument was checked")

    monkeypatch.setattr(cli, "init_params", refuse)
    monkeypatch.setattr(cli, "oracle_forward", refuse)
    monkeypatch.setattr("kda_jax.hf.load_hf_params", refuse)


def one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kda-jax: error: "), err
    return lines[0]


BAD_ARGUMENTS = [
    (["--preset", "nope"], ["unknown preset 'nope'"]),
    (["--batch", "0"], ["--batch=0 must be >= 1"]),
    (["--prompt", "-3"], ["--prompt=-3 must be >= 1"]),
    (["--decode", "0"], ["--decode=0 must be >= 1"]),
    (["--verify", "9"], ["--verify=9 exceeds max_verify=8"]),
    (["--checkpoint", "/nonexistent"], ["--checkpoint needs --layer"]),
    (["--checkpoint", "/nonexistent", "--layer", "0"], ["/nonexistent", "no config.json"]),
    (["--checkpoint", "/nonexistent", "--layer", "-1"], ["--layer=-1 must be >= 0"]),
    (["--layer", "3"], ["--layer only applies with --checkpoint"]),
    (["--backend", "cuda"], ["invalid choice"]),
    (["--prompt", "x"], ["invalid int value: 'x'"]),
    (["--batch", "2.5"], ["invalid int value: '2.5' is not an integer"]),
    (["--seed", "nan"], ["'nan' is not an integer"]),
    (["--seed", "1e20"], [f"--seed={10**20} must be < 4294967296 (2**32)"]),
    (["--seed", "-1"], ["--seed=-1 must be >= 0"]),
    (["--batch", "1e9"], ["--batch=1000000000", "needs about", " bytes", "more than"]),
    (["--prompt", "10_000_000_000"], ["--prompt=10000000000", "needs about", " bytes"]),
    (
        ["--preset", "kimi-linear-48b", "--batch", "64", "--prompt", "1e6"],
        ["needs about", "D=2304 H=32 K=128"],
    ),
]


@pytest.mark.parametrize(
    "args,patterns", [pytest.param(a, p, id=" ".join(a)) for a, p in BAD_ARGUMENTS]
)
def test_bad_arguments_one_clear_line_before_any_work(capsys, no_work, args, patterns):
    line = one_error_line(capsys, args)
    for p in patterns:
        assert p in line, line


def test_memory_estimate_uses_the_config(monkeypatch, capsys, no_work):
    """The refusal compares the config's estimate with the machine's memory."""
    cfg = K.preset("tiny")
    need = cli.estimate_bytes(cfg, 2, 3, 50 + 16 + 4, 4)
    monkeypatch.setattr(cli, "_memory_limit", lambda: (need - 1, "test memory"))
    line = one_error_line(capsys, ["--batch", "3", "--prompt", "50"])
    assert f"needs about {need} bytes" in line and f"{need - 1} bytes of test memory" in line
    big = cli.estimate_bytes(K.preset("kimi-linear-48b"), 2, 3, 70, 4)
    assert big > 20 * need  # the Kimi geometry costs more per token


@pytest.fixture
def checkpoint(tmp_path):
    cfg = K.preset("tiny")
    K.save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)), layer_idx=0)
    return tmp_path


def test_broken_checkpoints_one_clear_line(checkpoint, capsys):
    argv = ["--checkpoint", str(checkpoint), "--layer", "0"]
    line = one_error_line(capsys, [*argv[:-1], "1"])
    assert "layer_idx=1" in line  # num_hidden_layers is 1
    fn = checkpoint / "model.safetensors"
    t = load_file(fn)
    t[PREFIX.format(i=0) + "q_proj.weight"] = np.zeros((64, 96), np.int32)
    save_file(t, fn)
    line = one_error_line(capsys, argv)
    assert str(fn) in line and "q_proj.weight" in line and "I32" in line, line
    fn.write_bytes(fn.read_bytes()[:-100])
    line = one_error_line(capsys, argv)
    assert str(fn) in line and "not a readable safetensors file" in line, line


def test_numpy_integers_are_accepted(checkpoint):
    args = cli._parser().parse_args(["--checkpoint", str(checkpoint), "--layer", "0"])
    for name in ("batch", "prompt", "decode", "verify", "seed", "layer"):
        setattr(args, name, np.int64(getattr(args, name)))
    job, params = cli.prepare(args)
    assert job.batch == 2 and type(job.batch) is int and type(job.seed) is int
    params.check(job.cfg)
    args.batch = True
    with pytest.raises(cli.UsageError, match="--batch=True must be an int"):
        cli.prepare(args)


def test_out_of_memory_at_run_time_is_one_line(monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes.")

    monkeypatch.setattr(cli, "oracle_forward", oom)
    assert main(["--prompt", "8"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0] and "estimated at" in lines[0]


@pytest.mark.parametrize(
    "case",
    [
        "truncated checkpoint",
        *(pytest.param(c, marks=pytest.mark.slow) for c in ("huge batch", "huge seed")),
    ],
)
def test_no_traceback_from_the_command(tmp_path, case):
    """The installed entry point end to end: exit status 2, one line on stderr."""
    cfg = K.preset("tiny")
    K.save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)))
    fn = tmp_path / "model.safetensors"
    fn.write_bytes(fn.read_bytes()[:1000])
    args, pattern = {
        "truncated checkpoint": (["--checkpoint", str(tmp_path), "--layer", "0"], str(fn)),
        "huge batch": (["--batch", "1e9"], "needs about"),
        "huge seed": (["--seed", "1e20"], "--seed="),
    }[case]
    r = subprocess.run(
        [sys.executable, "-m", "kda_jax", *args], capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in r.stderr.strip().splitlines() if "Warning" not in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and pattern in lines[0], r.stderr


def test_argparse_namespace_from_python_is_checked_too():
    ns = argparse.Namespace(
        preset="tiny",
        checkpoint=None,
        layer=None,
        backend=None,
        dtype="fp16",
        batch=1,
        prompt=1,
        decode=1,
        verify=1,
        seed=0,
    )
    with pytest.raises(cli.UsageError, match="--dtype='fp16'"):
        cli.prepare(ns)
