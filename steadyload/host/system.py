"""Facts about this machine that explain failures: cgroup memory, /dev/shm, fd limits.

Read from /proc and /sys, cheaply, and never raising: a missing file means "unknown" (None).
Shared by the diagnosis of dead workers and by `steadyload doctor`.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """This process's cgroup memory limit and out-of-memory kill counter."""

    limit_bytes: int | None
    """None when unlimited or unknown."""
    oom_kills: int | None
    """cgroup v2 memory.events ``oom_kill`` (v1: memory.oom_control); None if unknown."""


def _cgroup_dir(pid: int | str = "self", root: Path = CGROUP_ROOT) -> Path | None:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0":  # cgroup v2 unified hierarchy
            path = root / parts[2].lstrip("/")
            return path if path.exists() else root
        if len(parts) == 3 and "memory" in parts[1].split(","):  # cgroup v1
            path = root / "memory" / parts[2].lstrip("/")
            return path if path.exists() else root / "memory"
    return None


def cpu_quota() -> float | None:
    """The cgroup CPU quota in CPUs (v2 cpu.max, v1 cfs_quota/period); None if unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        try:
            if hierarchy == "0":
                quota, period = Path(f"/sys/fs/cgroup{path}/cpu.max").read_text().split()[:2]
            elif "cpu" in controllers.split(","):
                base = Path(f"/sys/fs/cgroup/{controllers}{path}")
                quota = (base / "cpu.cfs_quota_us").read_text().strip()
                period = (base / "cpu.cfs_period_us").read_text().strip()
            else:
                continue
        except (OSError, ValueError):
            continue
        if quota.isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
            return int(quota) / int(period)  # "max" and "-1" mean unlimited
    return None


def cgroup_memory(root: Path = CGROUP_ROOT) -> CgroupMemory:
    """The memory limit and OOM-kill count of this process's cgroup (v2, else v1)."""
    directory = _cgroup_dir(root=root)
    if directory is None:
        return CgroupMemory(None, None)
    limit: int | None = None
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            limit = int(text)
        break
    kills: int | None = None
    for name in ("memory.events", "memory.oom_control"):
        try:
            for line in (directory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    kills = int(value)
        except OSError:
            continue
        if kills is not None:
            break
    return CgroupMemory(limit, kills)


def available_memory_bytes() -> int | None:
    """Memory this process can still use: the machine's available memory, capped by what
    is left under the cgroup limit."""
    available = _mem_available()
    if available is None:
        try:
            import psutil

            available = int(psutil.virtual_memory().available)
        except Exception:  # psutil missing or /proc unreadable: unknown
            return None
    limit = cgroup_memory().limit_bytes
    directory = _cgroup_dir()
    if limit is not None and directory is not None:
        try:
            used = int((directory / "memory.current").read_text())
            available = min(available, max(0, limit - used))
        except (OSError, ValueError):
            pass
    return available


def _mem_available() -> int | None:
    """Linux's own estimate, ``MemAvailable`` in /proc/meminfo (what psutil reports there),
    read directly: the loader asks on its first batch, which would otherwise wait for
    psutil's import (CHANGELOG, #38). None where there is none. [Unit: byte]"""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def total_memory_bytes() -> int | None:
    """Physical memory of the machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


@dataclass(frozen=True, slots=True)
class Space:
    """Size and free space of a filesystem (/dev/shm)."""

    path: str
    total_bytes: int
    free_bytes: int


def shm_space(path: str = "/dev/shm") -> Space | None:
    """Size and free space of ``path``; None when it does not exist."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return Space(path, st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail)


def fd_limits() -> tuple[int, int]:
    """(soft, hard) limit on open file descriptors (``ulimit -n``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def open_fds() -> int | None:
    """How many file descriptors this process has open."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def gib(n: int | None) -> str:
    """Bytes as a short human figure: ``7.9 GiB``, ``512 MiB``."""
    if n is None:
        return "unknown"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB"


def parse_bytes(text: str | int | None, name: str) -> int | None:
    """``"4GiB"``, ``"512MB"``, ``"1.5G"`` or an int -> bytes; None stays None.

    Raises:
        ValueError: naming ``name``, for text that is not a size.
    """
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{name} must be > 0 bytes or None, got {text!r}")
        return text
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a size like '4GiB' or a number of bytes, got {text!r}")
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6,
             "mb": 10**6, "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30,
             "t": 10**12, "tb": 10**12, "tib": 1 << 40}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(
            f"{name} must be a size like '4GiB', '512MB' or a number of bytes, got {text!r}"
        )
    return int(value * units[unit])


def memory_mappings(marker: str = "memfd:steadyload-w") -> tuple[int, int] | None:
    """(all memory mappings of this process, those whose name holds ``marker``: steadyload's
    batch segments); None when /proc is unreadable."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return len(lines), sum(marker in line for line in lines)


def max_map_count() -> int | None:
    """The kernel's limit on memory mappings per process (``vm.max_map_count``)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the process name (field 3 on: the state
    first, utime and stime at 11 and 12); None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(b")", 1)[-1].split()  # the name may hold spaces and parentheses


def process_state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, D, T stopped, t traced, Z...); None if gone."""
    fields = proc_stat(pid)
    return fields[0].decode() if fields else None


def pidfd_open(pid: int | None) -> int | None:
    """A descriptor that names process ``pid`` (readable once it exits), or None.

    Linux >= 5.3; it stays valid after the process is re-parented, so signals sent through
    it never reach a recycled pid. None when unavailable or the process is already gone.
    """
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def close_fds(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` (errors ignored) and empty the list."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass
