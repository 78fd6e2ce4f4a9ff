"""The KV cache is sized from the devices' own memory statistics on an accelerator, and from
kv_cache_memory on CPU (which reports none). Devices are stand-ins: the figure JAX reports is
the unit under test, not a GPU."""

import dataclasses

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


def test_cpu_or_no_statistics_leave_the_kv_budget_to_kv_cache_memory():
    assert _device_memory([FakeDevice("cpu", None)]) is None
    assert _device_memory([FakeDevice("gpu", None)]) is None
