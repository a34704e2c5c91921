"""Elastic resume in real multi-process runs (torchrun, gloo, CPU; tests/elastic_job.py): a
checkpoint taken on N ranks resumes on M, every sample of the epoch once over all ranks, in
the permutation's order. The rule itself, on every shape, is tests/unit/test_shards.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import elastic_job
from tests.conftest import wait_until
from tests.torchrun import ENV, torchrun

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _torchrun(out: Path, ranks: int, *flags: str) -> None:
    torchrun("tests.elastic_job", out, ranks, *flags)


def _steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _order(epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(5 + epoch)
    return torch.randperm(elastic_job.N, generator=g).tolist()


def _epoch(steps: list[dict[str, Any]], epoch: int) -> list[int]:
    """The epoch's samples as the ranks took them together: step by step, rank by rank
    (within a batch, position by position: a DistributedSampler deals one sample a rank)."""
    out = []
    for s in (s for s in steps if s["epoch"] == epoch):
        for j in range(elastic_job.BATCH):
            out += [batch[j] for batch in s["indices"] if j < len(batch)]
    return out


def test_four_ranks_resume_on_two_then_on_three_each_sample_once(tmp_path: Path) -> None:
    _torchrun(tmp_path, 4, "--steps", "3")  # 24 samples, then the job ends
    _torchrun(tmp_path, 2, "--steps", "3", "--workers", "2", "--kill-worker")  # 12 more
    _torchrun(tmp_path, 3)  # the rest of the epoch, then a whole one on 3 ranks
    steps = _steps(tmp_path)
    assert [s["world"] for s in steps[:6]] == [4, 4, 4, 2, 2, 2]
    healed = json.loads((tmp_path / "report_w2_r1.json").read_text())["restarts"]
    assert healed == ["killed by SIGKILL"]  # the worker died after the resume and was healed
    first = _epoch(steps, 0)
    assert first == _order(0)  # each sample once, in the permutation's order
    second = [s for s in steps if s["epoch"] == 1]
    for rank in range(3):  # the next epoch is the one a 3-rank run has
        mine = [i for s in second for i in s["indices"][rank]]
        sampler = torch.utils.data.DistributedSampler(elastic_job.Ids(), num_replicas=3,
                                                      rank=rank, seed=5)  # fmt: skip
        sampler.set_epoch(1)
        assert mine == list(sampler)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchrun_elastic_resumes_on_fewer_ranks_after_a_node_is_lost(tmp_path: Path) -> None:
    """Two torchrun agents (two "nodes", one rank each, --nnodes=1:2); node 2 is lost after
    5 steps; node 1's agent restarts its rank on a world of one, which resumes from the last
    checkpoint: over the whole run every sample of each epoch once."""
    port = _free_port()
    def agent(hosts_the_store: bool) -> list[str]:  # the lost node must not be the host
        conf = f"last_call_timeout=1,join_timeout=60,is_host={str(hosts_the_store).lower()}"
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=elastic", f"--rdzv-conf={conf}", "--max-restarts=2",
                "--monitor-interval=0.2", "-m", "tests.elastic_job", str(tmp_path),
                "--lose-node-at", "5"]  # fmt: skip

    log = [open(tmp_path / f"agent{i}.log", "w") for i in (1, 2)]
    agents = [subprocess.Popen(agent(i == 0), cwd=ROOT, env=ENV, stdout=f,
                               stderr=subprocess.STDOUT, start_new_session=True)
              for i, f in enumerate(log)]  # fmt: skip
    try:
        first = agents[0].wait(timeout=240)
        wait_until(lambda: agents[1].poll() is not None, 30, what="the lost node's agent")
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait(10)
        for f in log:
            f.close()
    text = (tmp_path / "agent1.log").read_text()
    assert first == 0, text[-6000:]
    steps = _steps(tmp_path)
    worlds = [s["world"] for s in steps]
    assert worlds[:5] == [2] * 5 and set(worlds[5:]) == {1}, worlds  # the rest on one rank
    assert _epoch(steps, 0) == _order(0)
    assert _epoch(steps, 1) == _order(1)
    assert json.loads((tmp_path / "report_w1_r0.json").read_text())["restarts"] == []
