"""Thread workers: a `ThreadPool` of threads in this process. Transport: the collated batch
itself, queued (no copy); liveness: an exception leaving the loop, or a hang abandoned."""
