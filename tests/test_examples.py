"""Fast checks of examples/recall.py: the MQAR data, the model's shapes, gradients through the
block, and the jitted decode loops against prefill. No full training here (the notebook
04_associative_recall.ipynb trains to >= 90% and asserts it)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, rel_rms
from flax import nnx

import kda_jax as K

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import recall  # noqa: E402

# Small enough for a few seconds on a CPU; num_pairs=5 makes T=20, not a multiple of the chunk.
SMALL = recall.RecallConfig(vocab=32, num_pairs=5, d_model=32, heads=2, head_dim=16, batch=4)
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """The model's own Linear/Embed use XLA dots, TF32 on a GPU by default: these tests compare
    code paths (decode loop vs prefill), not TF32 rounding, so they run at full fp32."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return recall.RecallLM(SMALL, rngs=nnx.Rngs(0))


def test_make_batch_is_a_correct_mqar_task():
    cfg = dataclasses.replace(recall.RecallConfig(), batch=16)
    tokens, targets, mask = map(np.asarray, recall.make_batch(cfg, jax.random.key(3)))
    n, half = cfg.num_pairs, cfg.vocab // 2
    assert tokens.shape == targets.shape == mask.shape == (16, 4 * n)
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
    for row in range(16):
        keys, values = tokens[row, 0 : 2 * n : 2], tokens[row, 1 : 2 * n : 2]
        q_keys, answers = tokens[row, 2 * n :: 2], tokens[row, 2 * n + 1 :: 2]
        assert len(set(keys.tolist())) == n, "keys of a row must be distinct"
        assert ((keys >= 1) & (keys < half)).all() and (
            (values >= half) & (values < cfg.vocab)
        ).all()
        assert sorted(q_keys.tolist()) == sorted(keys.tolist()), "every key is queried once"
        lookup = dict(zip(keys.tolist(), values.tolist(), strict=True))
        assert answers.tolist() == [lookup[k] for k in q_keys.tolist()]
    # The loss sits exactly on the query keys, whose target is the answer.
    want = np.zeros(4 * n)
    want[2 * n :: 2] = 1
    np.testing.assert_array_equal(mask, np.broadcast_to(want, mask.shape))
    np.testing.assert_array_equal(targets[:, 2 * n :: 2], tokens[:, 2 * n + 1 :: 2])
    # Rows differ (fresh draws), and a different key gives a different batch.
    assert len({tuple(r) for r in tokens.tolist()}) == 16
    other = np.asarray(recall.make_batch(cfg, jax.random.key(4))[0])
    assert not np.array_equal(tokens, other)


def test_config_refuses_more_pairs_than_keys():
    with pytest.raises(ValueError, match="num_pairs=40"):
        recall.RecallConfig(vocab=64, num_pairs=40)


@pytest.mark.slow
def test_forward_shapes_and_states(model):
    tokens, _, _ = recall.make_batch(SMALL, jax.random.key(0))
    logits, states = model(tokens)
    assert logits.shape == (SMALL.batch, SMALL.seq_len, SMALL.vocab)
    assert logits.dtype == jnp.float32
    assert len(states) == SMALL.layers
    kcfg = SMALL.kda()
    for st in states:
        st.check(kcfg, SMALL.batch)
        assert float(jnp.linalg.norm(st.recurrent)) > 0
    assert np.isfinite(np.asarray(logits)).all()
    step_logits, _ = model.decode(tokens[:, 0], recall.init_states(SMALL, SMALL.batch))
    assert step_logits.shape == (SMALL.batch, SMALL.vocab)


@pytest.mark.slow
def test_gradients_reach_every_kda_weight(model):
    batch = recall.make_batch(SMALL, jax.random.key(1))
    grads = nnx.jit(nnx.grad(lambda m, b: recall.loss_and_accuracy(m, *b)[0]))(model, batch)
    for i in range(SMALL.layers):
        for name in ("w_in", "f_b", "g_b", "conv_w", "a_log", "dt_bias", "o_norm_w", "o_proj"):
            g = np.asarray(grads["layers"][i]["attn"][name][...])
            assert np.isfinite(g).all(), f"layer {i} {name}: non-finite gradient"
            assert np.abs(g).max() > 0, f"layer {i} {name}: zero gradient"


@pytest.mark.slow
def test_decode_loop_reproduces_prefill_logits(model):
    tokens, _, _ = recall.make_batch(SMALL, jax.random.key(2))
    prefill_logits, prefill_states = model(tokens)
    step_logits, step_states = recall.decode_logits(model, tokens)
    assert rel_rms(step_logits, prefill_logits) < FP32_TOL
    for a, b in zip(step_states, prefill_states, strict=True):
        assert rel_rms(a.recurrent, b.recurrent) < FP32_TOL
        assert rel_rms(a.conv, b.conv) < FP32_TOL
    # Continuing from a carried state: prefill half, decode the rest.
    half = SMALL.seq_len // 2
    _, mid = model(tokens[:, :half])
    tail_logits, _ = recall.decode_logits(model, tokens[:, half:], mid)
    assert rel_rms(tail_logits, prefill_logits[:, half:]) < FP32_TOL


@pytest.mark.slow
def test_answer_by_decoding_matches_a_python_loop(model):
    tokens, _, _ = recall.make_batch(SMALL, jax.random.key(5))
    n = SMALL.num_pairs
    got = np.asarray(recall.answer_by_decoding(model, tokens))
    # The same free-running procedure, one eager step at a time.
    _, states = model(tokens[:, : 2 * n])
    want = []
    for i in range(n):
        logits, states = model.decode(tokens[:, 2 * n + 2 * i], states)
        ans = jnp.argmax(logits, -1).astype(jnp.int32)
        _, states = model.decode(ans, states)
        want.append(np.asarray(ans))
    np.testing.assert_array_equal(got, np.stack(want, axis=1))
    assert got.shape == (SMALL.batch, n)


@pytest.mark.slow
def test_a_few_training_steps_lower_the_loss():
    cfg = dataclasses.replace(SMALL, steps=20, lr=1e-2, warmup=5, batch=16)
    _, history = recall.train(cfg, eval_every=10, log=None)
    losses = [h["loss"] for h in history]
    assert [h["step"] for h in history] == [10, 20]
    assert losses[-1] < losses[0], losses
    assert all(0.0 <= h["eval_acc"] <= 1.0 for h in history)


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_serve_runs_a_trace_and_its_pool_matches_prefill(backend, capsys):
    """examples/serve.py end to end on a small trace: every request retires, and a retired
    sequence's pooled state equals one prefill of its inputs (the example's own check)."""
    import serve

    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(0), jnp.float32)
    eng = serve.EngineConfig(slots=5, max_prompts=2, bucket=20, max_decode=4)
    trace = serve.make_trace(6, 3, eng.bucket, 4, seed=1)
    res = serve.serve(params, cfg, eng, trace, backend=backend, progress=False)
    assert res["tokens"] == sum(r.prompt_len + r.gen_len for r in trace)
    assert res["check"] < FP32_TOL
    assert serve.main(["--requests", "5", "--steps", "2", "--max-gen", "3"]) == 0
    assert "tokens/s" in capsys.readouterr().out
