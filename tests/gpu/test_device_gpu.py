"""The device stage on a real GPU (CUDA, or ROCm through torch.cuda): copies that overlap
the training step, buffers never reused early, and the seed's hazard, fork after CUDA.

Skipped, not failed, where torch sees no GPU (this project's CI machine): run them with
``benchmarks/gpu_check.sh`` on a machine with one (and a GPU build of torch); what they
measured is in docs/guide/feeding-the-gpu.md.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import steadyload as sl

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
    pytest.mark.timeout(300),
]
ROOT = Path(__file__).resolve().parents[2]


class Frames(Dataset[torch.Tensor]):
    """Sample i: a 1 MiB float32 tensor full of i (a batch of 8 is 8 MiB)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((512, 512), float(i))


def _busy(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (a training step's kernels)."""
    torch.cuda._sleep(int(ms * 1e6))  # cycles at ~1 GHz: the order of magnitude is enough


def test_batches_arrive_on_the_gpu_whole_while_the_loop_is_busy() -> None:
    """Each batch is read by the loop's stream only after a long kernel, so a buffer (or
    device memory) reused before the loop's stream got to it would show as a wrong sum: the
    pinned buffers wait for their copy's event, the outputs are marked used on the loop's
    stream (record_stream). The cap (three batches) makes the pool reuse its buffers."""
    loader = sl.DataLoader(
        Frames(), batch_size=8, num_workers=2, device="cuda", pinned_memory_limit="24MiB"
    )
    sums = []
    for batch in loader:
        assert batch.is_cuda and batch.device.index == torch.cuda.current_device()
        _busy(20)
        sums.append(batch.sum(dim=(1, 2)))  # queued after the kernel on the loop's stream
        del batch  # its memory may be reused only once the sum has run
    torch.cuda.synchronize()
    expected = [torch.arange(8 * k, 8 * k + 8, dtype=torch.float32) * 512**2 for k in range(12)]
    assert [s.cpu().tolist() for s in sums] == [e.tolist() for e in expected]
    stage = loader.report().device
    assert stage is not None and stage.pinned_allocations <= 3 and stage.pinned_reuses >= 9, stage


def _normalise(batch: torch.Tensor) -> torch.Tensor:
    assert batch.is_cuda and torch.cuda.current_stream() != torch.cuda.default_stream()
    return (batch / 255.0).half()


def test_device_transform_runs_on_the_copy_stream_and_is_timed() -> None:
    loader = sl.DataLoader(
        Frames(), batch_size=8, num_workers=2, device="cuda", device_transform=_normalise
    )
    batches = list(loader)
    assert all(b.dtype == torch.float16 and b.is_cuda for b in batches)
    assert float(batches[1][0, 0, 0]) == pytest.approx(8 / 255.0, rel=1e-3)
    stage = loader.report().device
    assert stage is not None and stage.transform_s > 0, stage


HAZARD = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import DataLoader, Dataset

    class Uses(Dataset):
        def __len__(self): return 4
        def __getitem__(self, i):  # a GPU step inside the worker (an HF fast processor's)
            return torch.tensor(torch.ones(2, device="cuda").sum().item() * i)

    if __name__ == "__main__":
        torch.ones(1, device="cuda")  # the training process holds a CUDA context
        kind = sys.argv[1]
        if kind == "torch":
            print(list(DataLoader(Uses(), num_workers=2, multiprocessing_context="fork")))
        else:
            import steadyload as sl
            print(list(sl.DataLoader(Uses(), num_workers=2, start_method=kind)))
    """
)


def _hazard(tmp_path: Path, kind: str) -> subprocess.CompletedProcess[str] | None:
    script = tmp_path / "hazard.py"
    script.write_text(HAZARD)
    try:
        command = [sys.executable, str(script), kind]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None  # a deadlock, bounded


def test_fork_after_cuda_fails_with_torch_and_is_refused_or_avoided_by_steadyload(
    tmp_path: Path,
) -> None:
    torch_run = _hazard(tmp_path, "torch")
    reinit = "Cannot re-initialize CUDA in forked subprocess"
    assert torch_run is None or (torch_run.returncode != 0 and reinit in torch_run.stderr)
    refused = _hazard(tmp_path, "fork")
    assert refused is not None and refused.returncode != 0
    assert "UnsafeForkError" in refused.stderr and "CUDA" in refused.stderr, refused.stderr
    avoided = _hazard(tmp_path, "auto")  # forkserver: the workers have their own CUDA
    assert avoided is not None and avoided.returncode == 0, avoided.stderr
