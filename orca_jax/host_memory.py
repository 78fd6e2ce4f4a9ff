"""The host memory this process may still take: on CPU the KV cache's budget comes from it (the
memory plan, parallel/memory_plan.py). Linux only; elsewhere the figure is unknown (None). This
module does not import jax."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


def available_host_memory() -> int | None:
    """Bytes this process may still take: Linux's MemAvailable (free memory plus the caches the
    kernel can drop), lowered to what the memory limit of this process's cgroup leaves (a container's
    limit: MemAvailable there still counts the whole machine). None where /proc/meminfo cannot be
    read."""
    try:
        meminfo = dict(line.split(":", 1) for line in (PROC / "meminfo").read_text().splitlines() if ":" in line)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024  # "23858876 kB"
    except (OSError, KeyError, ValueError):
        return None
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _cgroup_room() -> int | None:
    """What the tightest memory limit among this process's cgroup and the root of the cgroup mount
    leaves: limit - usage + inactive file cache (usage counts the page cache, whose inactive part the
    kernel reclaims first, as `docker stats` does). None without a limit. cgroup v2 (memory.max) or
    v1 (memory/memory.limit_in_bytes)."""
    rooms = []
    for directory in _cgroup_directories():
        for limit_name, usage_name, inactive_key in (("memory.max", "memory.current", "inactive_file"),
                                                     ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                      "total_inactive_file")):
            try:
                limit = (directory / limit_name).read_text().strip()
                usage = int((directory / usage_name).read_text())
                stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            # No limit: v2 writes "max", v1 the largest page-aligned 64-bit number.
            if limit == "max" or int(limit) >= 1 << 62:
                continue
            rooms.append(max(0, int(limit) - usage + int(stat.get(inactive_key, 0))))
    return min(rooms) if rooms else None


def _cgroup_directories() -> list[Path]:
    """This process's memory cgroup directories (from /proc/self/cgroup: v2's "0::/path", v1's
    "N:memory:/path"), and the mount's roots, which inside a container with its own cgroup namespace
    are the container's cgroup."""
    directories = [CGROUP, CGROUP / "memory"]
    try:
        lines = (PROC / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return directories
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            directories.append(CGROUP / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            directories.append(CGROUP / "memory" / path.lstrip("/"))
    return [d for d in dict.fromkeys(directories) if d.is_dir()]
