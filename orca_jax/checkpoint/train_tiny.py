"""Trains the `tiny` preset on a synthetic counting language and saves it to checkpoints/tiny/.

The language: `<s> a a+d a+2d ... </s>`, counting up from a in steps of d (1..4) while the number
stays <= 63, then `</s>`. After the first two numbers every token is determined, so a test can check
that a generation is *right*: "<s> 3 5" must continue "7 9 11 ... 63 </s>".

Training packs many sequences onto one ragged token axis with segment ids, the same layout the
engine feeds the model. Runs in well under a minute on a laptop CPU:

    python -m orca_jax.checkpoint.train_tiny
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import AddedToken, Tokenizer as HFTokenizer, models, pre_tokenizers

from orca_jax.checkpoint.store import checkpoint_root, save_checkpoint
from orca_jax.config import load_model_preset
from orca_jax.model.decoder import init_decoder
from orca_jax.tokenizer import Tokenizer

MAX_NUMBER = 63
MAX_STEP = 4
BOS, EOS = MAX_NUMBER + 1, MAX_NUMBER + 2
PAD_SEGMENT = -1


def counting_sequence(start: int, step: int) -> list[int]:
    """Token ids of one sentence of the language: BOS, the numbers, EOS."""
    return [BOS, *range(start, MAX_NUMBER + 1, step), EOS]


def packed_batch(rng: np.random.Generator, num_tokens: int) -> dict[str, np.ndarray]:
    """Random sentences packed onto one axis of `num_tokens`; the tail is padding.

    `loss_mask` drops the targets no model could predict: the first number (any start) and the
    second (any step).
    """
    ids, positions, segments, mask = [], [], [], []
    segment = 0
    while True:
        step = int(rng.integers(1, MAX_STEP + 1))
        start = int(rng.integers(0, MAX_NUMBER + 1 - step))
        seq = counting_sequence(start, step)
        if len(ids) + len(seq) > num_tokens:
            break
        ids += seq
        positions += range(len(seq))
        segments += [segment] * len(seq)
        # mask[i] is for predicting seq[i + 1] from seq[: i + 1]
        mask += [0, 0] + [1] * (len(seq) - 3) + [0]
        segment += 1
    pad = num_tokens - len(ids)
    targets = ids[1:] + [0]
    return {
        "token_ids": np.array(ids + [0] * pad, np.int32),
        "positions": np.array(positions + [0] * pad, np.int32),
        "segment_ids": np.array(segments + [PAD_SEGMENT] * pad, np.int32),
        "targets": np.array(targets[: len(ids)] + [0] * pad, np.int32),
        "loss_mask": np.array(mask + [0] * pad, np.float32),
    }


def train(steps: int = 400, num_tokens: int = 512, learning_rate: float = 3e-3, seed: int = 0):
    """Returns (model, per-step losses)."""
    config = load_model_preset("tiny")
    model = init_decoder(config, seed=seed)
    optimizer = nnx.Optimizer(model, optax.adamw(optax.cosine_decay_schedule(learning_rate, steps)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            logits = model(batch["token_ids"], batch["positions"], batch["segment_ids"])  # [T, V]
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return jnp.sum(losses * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    losses = [float(train_step(model, optimizer, packed_batch(rng, num_tokens))) for _ in range(steps)]
    return model, losses


def tiny_tokenizer() -> Tokenizer:
    """Words are the numbers 0..63 separated by spaces; `<s>` is added in front of every prompt."""
    vocab = {str(n): n for n in range(MAX_NUMBER + 1)} | {"<s>": BOS, "</s>": EOS}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    return Tokenizer(hf, bos_token_id=BOS, eos_token_id=EOS, add_bos_token=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=checkpoint_root() / "tiny")
    args = parser.parse_args()
    start = time.perf_counter()
    model, losses = train(args.steps)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s; "
          f"loss {losses[0]:.3f} -> {np.mean(losses[-20:]):.4f}")
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    save_checkpoint(args.out, load_model_preset("tiny"), params, tiny_tokenizer())
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
