"""The head program is given the final norm's and the LM head's arrays only (decoder.LMHead): a
compiled call checks every argument it is handed, so passing the stage's every layer array to the
head cost host time each step for arrays it never reads."""


def test_the_head_takes_only_the_final_norm_and_lm_head(tiny_runner):
    stage = tiny_runner.stages[-1]
    config = tiny_runner.config
    assert {id(leaf) for leaf in stage.head_param_leaves} <= {id(leaf) for leaf in stage.param_leaves}  # not copies
    # The tiny model ties its LM head to the embedding: the head reads the final norm's scale and
    # the embedding matrix, nothing of the layers.
    assert config.tie_word_embeddings
    shapes = sorted(tuple(leaf.shape) for leaf in stage.head_param_leaves)
    assert shapes == sorted([(config.d_model,), (config.vocab_size, config.d_model)])
