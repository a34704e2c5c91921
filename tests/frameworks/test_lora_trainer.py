"""The LoRA recipe as a Trainer script: tiny offline Qwen2.5-VL, peft, 2 steadyload workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lora_vlm"

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _run(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=280)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_lora_trainer_script_trains_on_steadyload_workers_and_skips_bad_lines(
    tmp_path: Path,
) -> None:
    _run(str(EXAMPLE / "tiny_vlm.py"), "model", "data", "--samples", "32", "--bad-lines",
         cwd=tmp_path)
    out = _run(str(EXAMPLE / "train_trainer.py"), "--model", "model", "--dataset", "data",
               "--num-workers", "2", "--steps", "20", "--batch-size", "2", "--output",
               "adapter", cwd=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["steps"] == 20 and len(result["losses"]) == 20
    assert result["last5"] < result["first5"] - 0.1, result["losses"]
    skipped = {s["index"]: s["error"] for s in result["skipped"]}
    assert set(skipped) == {3, 7}  # the missing image and the malformed line, not fatal
    assert skipped[3].startswith("builtins.FileNotFoundError") and "missing.jpg" in skipped[3]
    assert skipped[7].startswith("json.decoder.JSONDecodeError")
    assert "start method forkserver" in result["report"]
    # The workers' parent is steadyload's fork server, not the training process.
    assert result["worker_parents"] == [result["fork_server_pid"]] != [result["pid"]]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
