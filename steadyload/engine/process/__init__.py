"""Process workers: a `ProcessPool` of forkserver/spawn/zygote children, their handles and
teardown. Transport: a socketpair per worker and batches in shared memory (../transport/);
liveness: the process sentinel and the fork server's pidfd."""
