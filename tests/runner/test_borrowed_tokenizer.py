"""`--tokenizer`: a model (a dummy one, typically) borrows another checkpoint's tokenizer, refused
when the tokenizer's ids would fall outside the model's vocabulary."""

import pytest

from orca_jax.config import REPO_ROOT, ConfigError, load_model_preset
from orca_jax.runner.builder import borrowed_tokenizer

from ..conftest import SMOLLM2

TINY_CHECKPOINT = str(REPO_ROOT / "checkpoints" / "tiny")


def test_a_tokenizer_that_fits_the_vocabulary_is_borrowed(smollm2):  # after `smollm2`, which pulls it
    tokenizer = borrowed_tokenizer(SMOLLM2, load_model_preset("llama-3-8b"))  # 49152 ids in 128256
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("Hello") == smollm2.tokenizer.encode("Hello")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_naming_both_sizes():
    with pytest.raises(ConfigError, match="has 49152 tokens but tiny has a vocabulary of 66"):
        borrowed_tokenizer(SMOLLM2, load_model_preset("tiny"))


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        borrowed_tokenizer(str(tmp_path), load_model_preset("tiny"))
