"""The LoRA recipe end to end: tiny offline Qwen2.5-VL, 2 steadyload workers, bad lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lora_vlm"

pytestmark = pytest.mark.timeout(300)


def _run(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=280)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_lora_training_with_two_workers_skips_bad_lines_and_saves_a_loadable_adapter(
    tmp_path: Path,
) -> None:
    _run(str(EXAMPLE / "tiny_vlm.py"), "model", "data", "--samples", "32", "--bad-lines",
         cwd=tmp_path)
    out = _run(str(EXAMPLE / "train.py"), "--model", "model", "--dataset", "data",
               "--num-workers", "2", "--steps", "20", "--batch-size", "2", "--output", "adapter",
               cwd=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["steps"] == 20 and len(result["losses"]) == 20
    assert result["last5"] < result["first5"] - 0.1, result["losses"]
    skipped = {s["index"]: s["error"] for s in result["skipped"]}
    assert set(skipped) == {3, 7}
    assert skipped[3].startswith("builtins.FileNotFoundError") and "missing.jpg" in skipped[3]
    assert skipped[7].startswith("json.decoder.JSONDecodeError")
    assert "start method forkserver" in result["report"]

    # The adapter loads again onto a fresh base model, with the trained LoRA weights.
    check = (
        "import sys, torch\n"
        "from safetensors.torch import load_file\n"
        "from peft import PeftModel\n"
        "from transformers import Qwen2_5_VLForConditionalGeneration\n"
        "base = Qwen2_5_VLForConditionalGeneration.from_pretrained('model', local_files_only=True)\n"
        "model = PeftModel.from_pretrained(base, 'adapter')\n"
        "saved = load_file('adapter/adapter_model.safetensors')\n"
        "loaded = {k: v for k, v in model.state_dict().items() if 'lora_' in k}\n"
        "assert len(saved) == len(loaded) > 0, (len(saved), len(loaded))\n"
        "b = [v for k, v in saved.items() if 'lora_B' in k]\n"
        "assert all(v.abs().sum() > 0 for v in b), 'lora_B is still zero: nothing was trained'\n"
        "for k, v in saved.items():\n"
        "    match = [w for name, w in loaded.items() if name.endswith(k.split('base_model.model.')[-1].replace('.weight', '.default.weight'))]\n"
        "    assert match and torch.equal(match[0], v), k\n"
        "print('adapter ok', len(saved))\n"
    )
    assert "adapter ok" in _run("-c", check, cwd=tmp_path)
