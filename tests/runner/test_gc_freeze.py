"""`orca-jax serve` moves the objects start-up made out of the garbage collector's sight
(builder.freeze_start_up_objects), so that full collections, frequent when many requests decode, do not
walk them. That is safe while an engine that goes out of use is freed by its reference counts alone: a
reference cycle among frozen objects is never collected. `LLM` does not freeze: it would freeze its
caller's whole heap (a notebook's cycles, never collected again)."""

import gc
import logging
import weakref

from orca_jax import LLM, SamplingParams
from orca_jax.config import REPO_ROOT
from orca_jax.runner.builder import freeze_start_up_objects


class Node:
    pass


def cycle() -> tuple[Node, weakref.ref]:
    """A reference cycle and a weak reference to it: once the caller drops it, only the collector frees it."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return first, weakref.ref(first)


def test_garbage_is_collected_before_the_freeze():
    first, alive = cycle()
    del first
    frozen_before = gc.get_freeze_count()
    try:
        freeze_start_up_objects()
        assert alive() is None, "garbage that existed at start-up was frozen instead of collected"
        assert gc.get_freeze_count() > frozen_before
    finally:
        gc.unfreeze()  # this test process is no server


def test_llm_leaves_the_callers_objects_to_the_collector():
    first, alive = cycle()  # the caller's, alive while the LLM is built (a notebook's)
    llm = LLM("tiny", max_num_seqs=2, show_progress=False)
    del first
    gc.collect()
    assert alive() is None, "LLM() froze its caller's objects: their cycles are never collected"
    del llm


def test_the_server_freezes_what_its_start_up_left(monkeypatch):
    """`orca-jax serve` with the server itself replaced: what its engine factory does to the process."""
    from orca_jax import cli
    from orca_jax.server import serve

    seen = {}

    async def engine_only(settings, engine_factory, host, port, **kwargs):
        frozen_before = gc.get_freeze_count()
        engine = engine_factory()
        seen["frozen"] = gc.get_freeze_count() - frozen_before
        engine.shutdown(timeout=30)
        return 0

    monkeypatch.setattr(serve, "serve", engine_only)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # the CLI's, for its own process
    orca_jax_level = logging.getLogger("orca_jax").level
    try:
        assert cli.main(["serve", "--model", str(REPO_ROOT / "checkpoints" / "tiny"), "--port", "0",
                         "--max-num-seqs", "2"]) == 0
    finally:
        gc.unfreeze()  # this test process is no server
        logging.getLogger("orca_jax").setLevel(orca_jax_level)
    assert seen["frozen"] > 0, "the server left start-up's objects to every full collection"


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
