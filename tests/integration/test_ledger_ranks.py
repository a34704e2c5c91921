"""The ledger under torchrun (gloo, CPU; tests/elastic_job.py): a run on N ranks crashes two
steps after its last checkpoint, a run on M ranks resumes from it, and `verify` proves
every epoch exactly once over all ranks and both runs, the crashed steps superseded."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadyload.resume.ledger.verify import verify
from tests import elastic_job
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _torchrun(out: Path, ranks: int, *flags: str, crash: bool = False) -> None:
    torchrun("tests.elastic_job", out, ranks, *flags, crash=crash)


@pytest.mark.parametrize(("first", "then"), [(2, 3), (4, 2)])
def test_a_crashed_run_resumed_on_other_ranks_verifies_exactly_once(
    tmp_path: Path, first: int, then: int
) -> None:
    ledger = str(tmp_path / "ledger")
    _torchrun(tmp_path, first, "--ledger", ledger, "--crash-after", "3", "--workers", "2",
              crash=True)  # fmt: skip
    _torchrun(tmp_path, then, "--ledger", ledger, "--workers", "2", "--kill-worker")
    verdict = verify(ledger)
    assert verdict.ok, str(verdict)
    assert [e.epoch for e in verdict.epochs] == list(range(elastic_job.EPOCHS))
    superseded = {(x.step.rank, x.step.epoch, x.step.step) for x in verdict.timeline.superseded}
    assert superseded == {(r, 0, k) for r in range(first) for k in (3, 4)}
