"""The host's free memory as the CPU KV budget reads it, from stand-in /proc and cgroup folders:
MemAvailable, lowered to what a cgroup limit leaves."""

import pytest

from orca_jax import host_memory

MiB = 1 << 20


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A fake /proc (MemAvailable 8000 MiB, this process in cgroup /job) and /sys/fs/cgroup."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {16000 * 1024} kB\nMemAvailable:   {8000 * 1024} kB\n")
    (proc / "self" / "cgroup").write_text("0::/job\n")
    (cgroup / "job").mkdir(parents=True)
    monkeypatch.setattr(host_memory, "PROC", proc)
    monkeypatch.setattr(host_memory, "CGROUP", cgroup)
    return proc, cgroup


def write_cgroup(directory, limit, usage, stat):
    (directory / "memory.max").write_text(f"{limit}\n")
    (directory / "memory.current").write_text(f"{usage}\n")
    (directory / "memory.stat").write_text(stat)


def test_mem_available_without_a_cgroup_limit(host):
    _, cgroup = host
    assert host_memory.available_host_memory() == 8000 * MiB
    write_cgroup(cgroup / "job", "max", 100 * MiB, "anon 1\n")  # "max": no limit
    assert host_memory.available_host_memory() == 8000 * MiB


def test_a_cgroup_limit_tighter_than_the_machine_counts_its_inactive_file_cache_as_free(host):
    _, cgroup = host
    # 4000 MiB limit, 3000 MiB used of which 500 MiB inactive page cache: 1500 MiB left.
    write_cgroup(cgroup / "job", 4000 * MiB, 3000 * MiB, f"anon 1\ninactive_file {500 * MiB}\n")
    assert host_memory.available_host_memory() == 1500 * MiB


def test_a_cgroup_v1_limit_is_read_too(host):
    proc, cgroup = host
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")
    v1 = cgroup / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2000 * MiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{1000 * MiB}\n")
    (v1 / "memory.stat").write_text(f"total_inactive_file {100 * MiB}\n")
    assert host_memory.available_host_memory() == 1100 * MiB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert host_memory.available_host_memory() == 8000 * MiB


def test_unknown_without_proc_meminfo(host):
    proc, _ = host
    (proc / "meminfo").unlink()
    assert host_memory.available_host_memory() is None


def test_this_machine_reports_a_figure():
    assert host_memory.available_host_memory() > 0
