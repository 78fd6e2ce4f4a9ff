"""build_engine moves the objects start-up made out of the garbage collector's sight
(builder.freeze_start_up_objects), so that full collections, frequent when many requests decode, do not
walk them. That is safe while an engine that goes out of use is freed by its reference counts alone: a
reference cycle among frozen objects is never collected."""

import gc
import weakref

from orca_jax import LLM, SamplingParams
from orca_jax.runner.builder import freeze_start_up_objects


class Node:
    pass


def test_garbage_is_collected_before_the_freeze():
    first, second = Node(), Node()
    first.other, second.other = second, first  # a cycle: only the collector frees it
    cycle = weakref.ref(first)
    del first, second
    frozen_before = gc.get_freeze_count()
    freeze_start_up_objects()
    assert cycle() is None, "garbage that existed at start-up was frozen instead of collected"
    assert gc.get_freeze_count() > frozen_before


def test_an_engine_out_of_use_is_freed_without_the_collector():
    llm = LLM("tiny", max_num_seqs=2, show_progress=False)
    llm.engine.add_request([llm.engine.model_config.bos_token_id, 1, 2], SamplingParams(max_tokens=4))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    engine, runner = weakref.ref(llm.engine), weakref.ref(llm.runner)
    gc.disable()
    try:
        del llm
        assert engine() is None and runner() is None, (
            "the engine is kept alive by a reference cycle: frozen at start-up, it would never be freed")
    finally:
        gc.enable()
