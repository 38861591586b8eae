"""A small language model built from KDA blocks, trained on multi-query associative recall.

MQAR (Zoology, Arora et al. 2023): a sequence lists `num_pairs` key-value pairs, then asks for
the value of every key again in a shuffled order; the loss (and the accuracy) counts only the
answers. A model can only solve it by writing the pairs into its state and reading them back,
which is what the delta rule of KDA is built for.

    tokens  k1 v1 k2 v2 ... kN vN | q1 a1 q2 a2 ... qN aN      (q_i a key, a_i its value)
    target                          ^a1   ^a2   ...   ^aN       (predicted at the q_i positions)

Everything here runs on a CPU in a couple of minutes on the `xla` backend; on a GPU it trains
through the `pallas` backend (the kernels forward, the xla path's VJP backward). `--backend`
picks one:

    .venv/bin/python examples/recall.py [--backend xla|pallas]

Pieces (all importable; `notebooks/04_associative_recall.ipynb` uses them):
  RecallConfig            sizes of the task and the model (frozen).
  make_batch              one batch of MQAR sequences with the answer mask.
  RecallLM                embedding -> 2 x [RMSNorm, KDA, residual, RMSNorm, MLP, residual] ->
                          RMSNorm -> head; `__call__` prefills, `decode` takes one token.
  train                   optax AdamW training loop (no decay on KDA's gate, norm and bias:
                          `K.weight_decay_mask`); returns the model and an accuracy curve.
  decode_logits           runs tokens one by one through a jitted `lax.scan` of `decode` steps,
                          carrying one KdaState per layer (must equal the prefill logits).
  answer_by_decoding      prefills the key-value context, then answers every query in a jitted
                          decode loop that feeds the model's own answers back.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import kda_jax as K
from kda_jax import backends

__all__ = [
    "RecallConfig",
    "make_batch",
    "RecallLM",
    "init_states",
    "loss_and_accuracy",
    "train",
    "evaluate",
    "decode_logits",
    "answer_by_decoding",
    "main",
]


@dataclasses.dataclass(frozen=True)
class RecallConfig:
    """Sizes of the MQAR task and of the model.

    Attributes:
      vocab: token count; keys come from [1, vocab // 2), values from [vocab // 2, vocab).
      num_pairs: N key-value pairs per sequence (distinct keys); the sequence is 4N tokens.
      d_model: width of the residual stream (= the KDA block's `hidden`).
      heads, head_dim: KDA geometry (P = heads * head_dim).
      layers: number of [KDA, MLP] layers.
      mlp_ratio: MLP hidden width over d_model.
      chunk: the KDA prefill chunk width.
      gate_lower_bound: None for the unbounded gate, e.g. -5.0 for the bounded one.
      tie_embeddings: the head reuses the embedding matrix.
      batch, steps, lr, warmup, weight_decay: training.
      seed: initialisation seed; data_seed: the stream of training batches.
      backend: the KDA backend ("xla", "pallas", or None: pallas on a GPU, xla elsewhere).
    """

    vocab: int = 64
    num_pairs: int = 16
    d_model: int = 64
    heads: int = 2
    head_dim: int = 32
    layers: int = 2
    mlp_ratio: int = 2
    chunk: int = 16
    gate_lower_bound: float | None = None
    tie_embeddings: bool = True
    batch: int = 64
    steps: int = 250
    lr: float = 1e-2
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    data_seed: int = 1
    backend: str | None = None

    @property
    def seq_len(self) -> int:
        return 4 * self.num_pairs

    def kda(self) -> K.KdaConfig:
        """The KDA block config of every layer."""
        return K.KdaConfig(
            hidden=self.d_model,
            heads=self.heads,
            head_dim=self.head_dim,
            conv_kernel=4,
            gate_lower_bound=self.gate_lower_bound,
            chunk=self.chunk,
        ).validate()

    def __post_init__(self):
        n_keys = self.vocab // 2 - 1
        if self.num_pairs > n_keys:
            raise ValueError(
                f"num_pairs={self.num_pairs} needs that many distinct keys, but vocab={self.vocab} "
                f"gives only {n_keys} (keys are 1 .. vocab//2 - 1)"
            )


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def make_batch(cfg: RecallConfig, key: jax.Array, batch: int | None = None):
    """One batch of MQAR sequences.

    Args:
      cfg: task sizes; key: a jax random key; batch: rows (default cfg.batch).
    Returns:
      tokens: [B, 4N] int32 (pairs, then queries each followed by its answer);
      targets: [B, 4N] int32, the next token (the last position repeats its own token);
      mask: [B, 4N] float32, 1 at the query positions (where the answer is predicted), else 0.
    """
    b = cfg.batch if batch is None else batch
    n, half = cfg.num_pairs, cfg.vocab // 2
    k_keys, k_vals, k_perm = jax.random.split(key, 3)
    # Distinct keys per row: the first N of a random permutation of 1 .. half-1.
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, half - 1))(jax.random.split(k_keys, b))
    keys = perm[:, :n] + 1
    values = jax.random.randint(k_vals, (b, n), half, cfg.vocab)
    order = jax.vmap(lambda kk: jax.random.permutation(kk, n))(jax.random.split(k_perm, b))
    q_keys = jnp.take_along_axis(keys, order, axis=1)
    q_vals = jnp.take_along_axis(values, order, axis=1)
    context = jnp.stack([keys, values], axis=-1).reshape(b, 2 * n)
    queries = jnp.stack([q_keys, q_vals], axis=-1).reshape(b, 2 * n)
    tokens = jnp.concatenate([context, queries], axis=1).astype(jnp.int32)
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    pos = jnp.arange(4 * n)
    mask = (pos >= 2 * n) & ((pos - 2 * n) % 2 == 0)
    return tokens, targets, jnp.broadcast_to(mask, (b, 4 * n)).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class Layer(nnx.Module):
    """Pre-norm residual layer: x + KDA(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, cfg: RecallConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = K.KimiDeltaAttention(
            cfg.kda(), rngs=rngs, backend=cfg.backend, dtype=jnp.float32
        )
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
        self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

    def _mlp(self, x: jax.Array) -> jax.Array:
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))

    def prefill(self, x: jax.Array, state: K.KdaState) -> tuple[jax.Array, K.KdaState]:
        """x [B, T, d] -> (x [B, T, d], state)."""
        y, state = self.attn.prefill(self.attn_norm(x), state)
        return self._mlp(x + y), state

    def decode(self, x: jax.Array, state: K.KdaState) -> tuple[jax.Array, K.KdaState]:
        """x [B, d] -> (x [B, d], state)."""
        y, state = self.attn.decode(self.attn_norm(x), state)
        return self._mlp(x + y), state


class RecallLM(nnx.Module):
    """Token model: embedding, `cfg.layers` KDA layers, final RMSNorm, (tied) head.

    The recurrent state is explicit: a tuple with one `KdaState` per layer (`init_states`).
    """

    def __init__(self, cfg: RecallConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = None if cfg.tie_embeddings else nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)

    def __call__(self, tokens: jax.Array, states=None):
        """Prefill. tokens [B, T] int -> (logits [B, T, vocab] fp32, states)."""
        if states is None:
            states = init_states(self.cfg, tokens.shape[0])
        x = self.embed(tokens)
        new_states = []
        for layer, state in zip(self.layers, states, strict=True):
            x, state = layer.prefill(x, state)
            new_states.append(state)
        return self._logits(x), tuple(new_states)

    def decode(self, token: jax.Array, states):
        """One step. token [B] int -> (logits [B, vocab] fp32, states)."""
        x = self.embed(token)
        new_states = []
        for layer, state in zip(self.layers, states, strict=True):
            x, state = layer.decode(x, state)
            new_states.append(state)
        return self._logits(x), tuple(new_states)


def init_states(cfg: RecallConfig, batch: int) -> tuple[K.KdaState, ...]:
    """A fresh state per layer for `batch` sequences."""
    return tuple(K.KdaState.zeros(cfg.kda(), batch) for _ in range(cfg.layers))


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def loss_and_accuracy(model: RecallLM, tokens, targets, mask):
    """Masked cross-entropy and answer accuracy over a batch (both scalars)."""
    logits, _ = model(tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    loss = jnp.sum(ce * mask) / jnp.sum(mask)
    acc = jnp.sum((jnp.argmax(logits, -1) == targets) * mask) / jnp.sum(mask)
    return loss, acc


@nnx.jit
def _train_step(model: RecallLM, opt: nnx.Optimizer, tokens, targets, mask):
    grad_fn = nnx.value_and_grad(loss_and_accuracy, has_aux=True)
    (loss, acc), grads = grad_fn(model, tokens, targets, mask)
    opt.update(model, grads)
    return loss, acc


@nnx.jit
def _eval_step(model: RecallLM, tokens, targets, mask):
    return loss_and_accuracy(model, tokens, targets, mask)


def evaluate(model: RecallLM, cfg: RecallConfig, key: jax.Array, batch: int = 256) -> float:
    """Answer accuracy (teacher-forced prefill) on a fresh batch."""
    _, acc = _eval_step(model, *make_batch(cfg, key, batch))
    return float(acc)


def train(cfg: RecallConfig = RecallConfig(), *, eval_every: int = 50, log=print):
    """Trains a fresh `RecallLM` with AdamW (warmup + cosine decay, gradient clipping).

    Returns:
      (model, history): history is a list of dicts {step, loss, train_acc, eval_acc, seconds}
      taken every `eval_every` steps and at the last step; eval_acc is measured on one fixed
      held-out batch of 256 sequences drawn from a separate seed.
    """
    model = RecallLM(cfg, rngs=nnx.Rngs(cfg.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup, cfg.steps // 2), max(cfg.steps, 2), end_value=0.1 * cfg.lr
    )
    # Weight decay on the matrices, not on KDA's gate parameters, norm weight or gate bias.
    adamw = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=K.weight_decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    data_key = jax.random.key(cfg.data_seed)
    eval_key = jax.random.key(cfg.data_seed + 10_000)
    batches = jax.jit(make_batch, static_argnums=(0, 2))
    history, start = [], time.perf_counter()
    for step in range(1, cfg.steps + 1):
        batch = batches(cfg, jax.random.fold_in(data_key, step))
        loss, acc = _train_step(model, opt, *batch)
        if step % eval_every == 0 or step == cfg.steps:
            rec = dict(
                step=step,
                loss=float(loss),
                train_acc=float(acc),
                eval_acc=evaluate(model, cfg, eval_key),
                seconds=time.perf_counter() - start,
            )
            history.append(rec)
            if log is not None:
                log(
                    f"step {step:5d}  loss {rec['loss']:.4f}  train acc {rec['train_acc']:.3f}  "
                    f"eval acc {rec['eval_acc']:.3f}  ({rec['seconds']:.0f} s)"
                )
    return model, history


# ----------------------------------------------------------------------------------------------
# Decoding: a jitted loop carrying one KdaState per layer
# ----------------------------------------------------------------------------------------------
@nnx.jit
def decode_logits(model: RecallLM, tokens: jax.Array, states=None):
    """Feeds tokens [B, T] one at a time through `model.decode` inside one `lax.scan`.

    Returns (logits [B, T, vocab], states): with `states=None` (fresh), the logits must equal
    `model(tokens)[0]` up to fp32 rounding: that is the forward-equals-incremental check.
    """
    if states is None:
        states = init_states(model.cfg, tokens.shape[0])

    def step(carry, tok):
        logits, carry = model.decode(tok, carry)
        return carry, logits

    states, logits = jax.lax.scan(step, states, tokens.T)
    return jnp.moveaxis(logits, 0, 1), states


@nnx.jit
def answer_by_decoding(model: RecallLM, tokens: jax.Array):
    """Answers the queries of MQAR sequences free-running, one decode step at a time.

    Prefills the 2N context tokens, then for each query: decode the key, take the argmax as the
    answer, decode that answer (the model's own, not the true one) and go on. The loop is a
    `lax.fori_loop` carrying the per-layer states.

    Args:
      tokens: [B, 4N] from `make_batch` (only the context and the query keys are read).
    Returns:
      answers [B, N] int32, in query order.
    """
    cfg = model.cfg
    n = cfg.num_pairs
    _, states = model(tokens[:, : 2 * n])
    q_keys = tokens[:, 2 * n :: 2]  # [B, N]

    def body(i, carry):
        states, answers = carry
        logits, states = model.decode(q_keys[:, i], states)
        ans = jnp.argmax(logits, -1).astype(jnp.int32)
        _, states = model.decode(ans, states)
        return states, answers.at[:, i].set(ans)

    answers = jnp.zeros(q_keys.shape, jnp.int32)
    _, answers = jax.lax.fori_loop(0, n, body, (states, answers))
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", choices=("xla", "pallas"), default=None)
    cfg = RecallConfig(backend=parser.parse_args().backend)
    backend = backends.resolve(cfg.backend)
    print(
        f"MQAR: vocab {cfg.vocab}, {cfg.num_pairs} pairs, seq len {cfg.seq_len}; model "
        f"{cfg.layers} x KDA(d={cfg.d_model}, heads={cfg.heads}, head_dim={cfg.head_dim}), "
        f"{cfg.steps} steps of batch {cfg.batch}, backend {backend} on {jax.default_backend()}"
    )
    model, history = train(cfg)
    final = history[-1]["eval_acc"]
    print("accuracy curve (step: eval acc):")
    print("  " + ", ".join(f"{h['step']}: {h['eval_acc']:.3f}" for h in history))

    tokens, targets, mask = make_batch(cfg, jax.random.key(12345), 64)
    prefill_logits, _ = model(tokens)
    step_logits, _ = decode_logits(model, tokens)
    err = float(jnp.max(jnp.abs(step_logits - prefill_logits)) / jnp.max(jnp.abs(prefill_logits)))
    print(f"decode loop vs prefill logits: max |diff| / max |logit| = {err:.2e}")
    answers = answer_by_decoding(model, tokens)
    truth = tokens[:, 2 * cfg.num_pairs + 1 :: 2]
    print(f"free-running decode accuracy: {float(jnp.mean(answers == truth)):.3f}")
    if final < 0.9:
        raise SystemExit(f"final eval accuracy {final:.3f} < 0.9")


if __name__ == "__main__":
    main()
