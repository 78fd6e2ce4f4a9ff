"""The default buckets reach down to one token and one sequence: a decode step of n sequences runs in
the smallest bucket that holds n (a step of one sequence costs one row of matmuls, not 16), without
a compilation after warm-up, and gives the tokens the coarse buckets give."""

from orca_jax.engine.step_plan import Buckets
from orca_jax.engine_args import config_from_keywords
from orca_jax.runner.model_runner import ModelRunner, RunnerStats
from orca_jax.sampling_params import SamplingParams

from ..engine.conftest import make_engine, run_all

LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64)
NEW_TOKENS = 6  # the prefill step samples the first; five decode steps follow


def test_a_decode_of_few_sequences_runs_in_the_smallest_bucket(tiny_trained, tiny_runner):
    buckets = Buckets.for_limits(LIMITS["max_num_batched_tokens"], LIMITS["max_num_seqs"])
    assert buckets.tokens[:4] == (1, 2, 4, 8) and buckets.seqs[:3] == (1, 2, 4)
    runner = ModelRunner(tiny_trained.model, config_from_keywords(page_size=4, attention_impl="xla"), num_pages=64,
                         max_model_len=128, buckets=buckets)
    runner.warm_up(show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for n, decode_bucket in ((1, (1, 1)), (2, (2, 2)), (3, (4, 4))):
        requests = [([2 + i, 3 + i, 4 + i, 5 + i, 6 + i], params) for i in range(n)]
        runner.stats = RunnerStats()
        outputs = run_all(make_engine(runner, tiny_trained, "chunked", **LIMITS), requests)
        assert runner.stats.buckets[decode_bucket] == NEW_TOKENS - 1, (n, runner.stats.buckets)
        assert runner.stats.steps == NEW_TOKENS  # and one prefill step
        coarse = run_all(make_engine(tiny_runner, tiny_trained, "chunked", **LIMITS), requests)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in coarse]
    assert runner.num_compilations_after_warmup == 0
