"""The KV cache is sized from the devices' own memory statistics on an accelerator, and from the
host's free memory on CPU (which reports none), or from kv_cache_memory when given. Devices are
stand-ins: the figure JAX reports is the unit under test, not a GPU. The CPU tests build the tiny
model's runner without warming it up: nothing compiles."""

import dataclasses

import pytest

from orca_jax.config import (DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig, ConfigError, EngineConfig, ParallelConfig,
                             SchedulerConfig, load_model_preset)
from orca_jax.parallel.memory_plan import plan_memory
from orca_jax.runner import builder
from orca_jax.runner.builder import _device_memory


@dataclasses.dataclass
class FakeDevice:
    platform: str
    bytes_limit: int | None
    process_index: int = 0

    def memory_stats(self):
        return None if self.bytes_limit is None else {"bytes_limit": self.bytes_limit, "bytes_in_use": 0}


def test_the_smallest_accelerator_of_this_process_sets_the_device_memory():
    devices = [FakeDevice("gpu", 80 << 30), FakeDevice("gpu", 60 << 30), FakeDevice("gpu", 10 << 30, process_index=1)]
    assert _device_memory(devices) == 60 << 30  # the other process's device is its own business


def test_cpu_or_no_statistics_report_no_device_memory():
    assert _device_memory([FakeDevice("cpu", None)]) is None
    assert _device_memory([FakeDevice("gpu", None)]) is None


# On CPU the host's free memory sizes the cache (orca_jax/host_memory.py reads it; the builder reads it
# once, through the name it imported, which these tests replace with a figure of their own).

def tiny_config(max_model_len=None, kv_cache_memory=None) -> EngineConfig:
    return EngineConfig(model="tiny", max_model_len=max_model_len,
                        cache=CacheConfig(page_size=16, kv_cache_memory=kv_cache_memory),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))


def tiny_runner(config: EngineConfig, free_host_memory: int, monkeypatch):
    monkeypatch.setattr(builder, "available_host_memory", lambda: free_host_memory)
    return builder.build_runner(config, builder.BuildOptions(token_buckets=[16], seq_buckets=[4],
                                                             show_progress=False))


@pytest.fixture(scope="module")
def tiny_figures() -> tuple[int, int]:
    """The tiny model's KV bytes per page (page_size 16) and parameter bytes, as the plan counts them."""
    plan = plan_memory(load_model_preset("tiny"), ParallelConfig(), page_size=16, kv_cache_memory=1 << 20)
    return plan.kv_bytes_per_page, plan.param_bytes


def test_a_context_that_does_not_fit_the_host_memory_starts_lowered_saying_so(tiny_figures, monkeypatch, capfd):
    page, params = tiny_figures
    free = params + int(5.5 * page / 0.9)  # 0.9 of what the parameters leave: 5 whole pages of 16 tokens
    runner, _, max_model_len = tiny_runner(tiny_config(), free, monkeypatch)
    assert (runner.num_pages, max_model_len, runner.max_pages_per_seq) == (5, 80, 5)
    err = capfd.readouterr().err
    assert "orca_jax: max_model_len lowered from tiny's context length 128 to 80 tokens" in err
    assert err.count("lowered") == 1  # one line, even without progress output


def test_a_given_max_model_len_that_does_not_fit_is_refused_naming_the_figures(tiny_figures, monkeypatch):
    page, params = tiny_figures
    free = params + int(5.5 * page / 0.9)
    refusal = (r"the KV cache holds 80 tokens per device \(0.9 x \(.* free host memory - parameters\)\), less than "
               r"one sequence of max_model_len=128; short by .* per device. Lower max_model_len to 80 or less, or give "
               r"the KV cache more memory \(free memory on the host, raise the memory utilization or give "
               r"kv_cache_memory\)")
    with pytest.raises(ConfigError, match=refusal):
        tiny_runner(tiny_config(max_model_len=128), free, monkeypatch)


def test_plenty_of_host_memory_gives_max_num_seqs_sequences_and_no_more(monkeypatch):
    runner, _, max_model_len = tiny_runner(tiny_config(), 1 << 40, monkeypatch)  # a 1 TiB host
    assert (runner.num_pages, max_model_len) == (4 * 8, 128)  # 4 sequences of 128 tokens, in pages of 16
    runner, _, _ = tiny_runner(tiny_config(max_model_len=48), 1 << 40, monkeypatch)
    assert runner.num_pages == 4 * 3


def test_a_given_kv_cache_memory_wins_over_the_host_memory(tiny_figures, monkeypatch):
    page, _ = tiny_figures
    runner, _, _ = tiny_runner(tiny_config(kv_cache_memory=100 * page), 1 << 40, monkeypatch)
    assert runner.num_pages == 100  # neither the host's figure nor the 4-sequence cap


def test_an_unknown_host_memory_falls_back_to_the_fixed_default_capped_too(tiny_figures, monkeypatch):
    page, _ = tiny_figures
    assert DEFAULT_CPU_KV_CACHE_MEMORY // page > 4 * 8
    runner, _, _ = tiny_runner(tiny_config(), None, monkeypatch)
    assert runner.num_pages == 4 * 8  # what 4 sequences take, not the 1 GiB default
    monkeypatch.setattr(builder, "DEFAULT_CPU_KV_CACHE_MEMORY", 20 * page)
    runner, _, _ = tiny_runner(tiny_config(), None, monkeypatch)
    assert runner.num_pages == 20
