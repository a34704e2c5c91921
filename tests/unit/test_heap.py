"""`HeapFit` with an injected ``mallopt``: which thresholds a batch's size sets, and when."""

from __future__ import annotations

import pytest

from steadyload.host import heap
from steadyload.host.heap import FIT_FROM, HeapFit

MIB = 1 << 20
MMAP, TRIM = -3, -1


class Mallopt:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_small_batches_leave_glibcs_own_rule_alone() -> None:
    mallopt = Mallopt()
    fit = HeapFit(mallopt)
    fit.batch(0)
    fit.batch(FIT_FROM - 1)
    assert mallopt.calls == [] and fit.threshold == 0


def test_a_big_batch_sets_both_thresholds_and_only_growth_sets_them_again() -> None:
    mallopt = Mallopt()
    fit = HeapFit(mallopt)
    fit.batch(16 * MIB)
    assert mallopt.calls == [(MMAP, 20 * MIB), (TRIM, 40 * MIB)]
    fit.batch(16 * MIB)
    fit.batch(8 * MIB)  # smaller: nothing lowered
    assert len(mallopt.calls) == 2
    fit.batch(20 * MIB)
    assert mallopt.calls[2:] == [(MMAP, 25 * MIB), (TRIM, 50 * MIB)]
    assert fit.threshold == 25 * MIB


def test_the_threshold_stops_at_glibcs_own_ceiling() -> None:
    mallopt = Mallopt()
    fit = HeapFit(mallopt)
    fit.batch(200 * MIB)
    assert mallopt.calls == [(MMAP, 32 * MIB), (TRIM, 64 * MIB)]
    fit.batch(400 * MIB)
    assert len(mallopt.calls) == 2


def test_a_refusal_is_not_asked_again() -> None:
    mallopt = Mallopt(answer=0)
    fit = HeapFit(mallopt)
    fit.batch(4 * MIB)
    fit.batch(8 * MIB)
    assert mallopt.calls == [(MMAP, 5 * MIB)] and fit.threshold == 0


def test_glibcs_mallopt_is_looked_up_at_the_first_big_batch_and_on_glibc_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[int] = []
    monkeypatch.setattr(heap, "_glibc_mallopt", lambda: looked_up.append(1))
    fit = HeapFit()
    fit.batch(FIT_FROM - 1)
    assert looked_up == []
    fit.batch(FIT_FROM)
    fit.batch(2 * FIT_FROM)
    assert looked_up == [1] and fit.threshold == 0  # None: nothing set, asked once
    monkeypatch.undo()
    monkeypatch.setattr(heap.os, "confstr", lambda name: "musl")
    assert heap._glibc_mallopt() is None
    monkeypatch.setattr(heap.os, "confstr", lambda name: "glibc 2.36")
    assert callable(heap._glibc_mallopt())
