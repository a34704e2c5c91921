"""Facts about this host (system.py: cgroup memory, CPUs, /dev/shm, fd limits) and what
running out of them means (limits.py: descriptors, mappings, a worker's start)."""
