"""Fixtures shared by the integration tests."""

from __future__ import annotations

from typing import Any

import pytest

from steadyload.engine.choice import handover, worker_kind


@pytest.fixture
def force_auto(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``force_auto(kind)``: worker_type="auto" chooses ``kind`` at its first look, whatever
    it measures (None: it never decides). The rule itself is tested with injected
    measurements (tests/unit/test_worker_kind.py) and measured in
    benchmarks/bench_peers.py; the tests using this are about the hand-over."""

    def force(kind: str | None) -> None:
        def rule(measured: Any, workers: int, probe: Any, on: str = "thread") -> Any:
            return worker_kind.chose(kind, f"forced by the test ({kind})") if kind else None

        monkeypatch.setattr(handover, "live_choice", rule)

    return force
