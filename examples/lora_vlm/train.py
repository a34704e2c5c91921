"""LoRA fine-tuning of Qwen2.5-VL through steadyload's forkserver workers: the recipe, runnable.

Run (after `python tiny_vlm.py MODEL DATA`, or with a real checkpoint directory):

    python train.py --model MODEL --dataset DATA --num-workers 2 --steps 20 --output adapter

Each line of the recipe and why it is there:
- steadyload workers start from a fork server, never by fork(), so a CUDA/ROCm context in
  this process cannot deadlock them; no `set_start_method` is needed.
- The dataset class is at module level, so workers can import it.
- The processor is a `steadyload.per_worker`: built once in each worker on first use,
  never pickled with the dataset.
- Lines are parsed lazily in the worker: a malformed line or a missing image raises there,
  and `on_error="skip"` leaves that sample out and lists it at the end.
- peft and the model class are imported inside `main()`: workers import this module to
  find the dataset, and do not need them.
- `steadyload.prestart` starts the fork server first thing, so that it imports torch,
  PIL and the processor code while this process imports them too; the loader is then
  built before the model, so whatever is left overlaps with loading the model.
- Training runs under `if __name__ == "__main__":`, since workers import this file.

With a real checkpoint (for example Qwen2.5-VL-7B-Instruct on a GPU machine with
torchvision) the script works unchanged: `load_processor` then returns the stock processor.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

import steadyload as sl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    # First thing: the fork server imports what the workers need (torch, PIL, and the
    # processor code in tiny_vlm, which imports transformers) while this process does too.
    sl.prestart(["torch", "PIL.Image", "tiny_vlm"])

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_vlm import load_processor  # noqa: E402  (beside this file)
from torch.utils.data import Dataset  # noqa: E402


class VLMJSONLDataset(Dataset[dict[str, torch.Tensor]]):
    """One sample per JSONL line: an image, a question, and the answer to learn."""

    def __init__(self, jsonl: str, processor_dir: str) -> None:
        with open(jsonl, encoding="utf-8") as f:
            self.lines = f.read().splitlines()
        self.root = os.path.dirname(jsonl)
        # Built lazily, once per worker process; the dataset pickles without it.
        self.processor = sl.per_worker(functools.partial(load_processor, processor_dir))

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = json.loads(self.lines[i])  # a malformed line raises here, in the worker
        proc = self.processor.get()
        image = Image.open(os.path.join(self.root, row["image"])).convert("RGB")
        messages = [
            {"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": row["question"]}]},
            {"role": "assistant", "content": [{"type": "text", "text": row["answer"]}]},
        ]
        text = proc.apply_chat_template(messages, tokenize=False)
        enc = proc(text=[text], images=[image], return_tensors="pt")
        item = {k: v[0] for k, v in enc.items() if k not in ("pixel_values", "image_grid_thw")}
        # Loss on the answer only: byte-level BPE splits after "assistant\n", so the last
        # len(tokens(answer + "<|im_end|>\n")) tokens are exactly the answer.
        n = len(proc.tokenizer(row["answer"] + "<|im_end|>\n")["input_ids"])
        item["labels"] = torch.full_like(item["input_ids"], -100)
        item["labels"][-n:] = item["input_ids"][-n:]
        item["pixel_values"] = enc["pixel_values"]
        item["image_grid_thw"] = enc["image_grid_thw"]
        return item


def collate(batch: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad the text fields; concatenate the image patches (module level: picklable)."""
    length = max(len(b["input_ids"]) for b in batch)
    fill = {"input_ids": pad_id, "labels": -100}  # attention_mask, mm_token_type_ids: 0
    out = {
        k: torch.stack([torch.nn.functional.pad(b[k], (0, length - len(b[k])),
                                                value=fill.get(k, 0)) for b in batch])
        for k in batch[0] if k not in ("pixel_values", "image_grid_thw")
    }
    return {**out, "pixel_values": torch.cat([b["pixel_values"] for b in batch]),
            "image_grid_thw": torch.cat([b["image_grid_thw"] for b in batch])}


def _memory(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in [os.getpid(), *pids]:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def arguments(argv: list[str] | None, description: str | None) -> argparse.Namespace:
    """The recipe's command line (also train_trainer.py's), and this process's threads."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, help="directory with train.jsonl and images")
    ap.add_argument("--model", required=True, help="model + processor directory")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2, help="1e-2 for the tiny model; ~1e-4 for 7B")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--output", default="lora-adapter", help="where the adapter is saved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads of this process; 0: the CPUs the workers leave free")
    args = ap.parse_args(argv)
    if args.threads or args.num_workers:
        # Workers and this process's torch threads share the CPUs: oversubscribed, torch's
        # OpenMP threads spin while the workers wait for a core. Leave the workers theirs.
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) - args.num_workers))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; print and return the results (losses, speed, memory, skipped lines)."""
    args = arguments(argv, __doc__)

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workers = dict(num_workers=args.num_workers, persistent_workers=True, prefetch_factor=2)
    loader = sl.DataLoader(
        VLMJSONLDataset(os.path.join(args.dataset, "train.jsonl"), args.model),
        batch_size=args.batch_size, shuffle=True, collate_fn=collate,
        pin_memory=torch.cuda.is_available(), on_error="skip",
        generator=torch.Generator().manual_seed(args.seed),
        **(workers if args.num_workers > 0 else {}),
    )
    loader_built = time.perf_counter()

    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, local_files_only=True)
    model = get_peft_model(model.to(device), LoraConfig(
        r=args.lora_r, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))  # the language model only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    model_ready = time.perf_counter()

    losses: list[float] = []
    step_times: list[float] = []
    data_wait = 0.0
    samples = 0
    first_batch_s = None
    peak = 0
    while len(losses) < args.steps:
        iter_start = time.perf_counter()
        it = iter(loader)
        while len(losses) < args.steps:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            if first_batch_s is None:
                first_batch_s = t1 - iter_start
            loss = model(**{k: v.to(device, non_blocking=True) for k, v in batch.items()}).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            step_times.append(time.perf_counter() - t0)
            data_wait += t1 - t0
            samples += len(batch["input_ids"])
            peak = max(peak, _memory([w.pid for w in loader.report().workers if w.pid]))
    model.save_pretrained(args.output)  # the LoRA adapter only
    report = loader.report(all_epochs=True)  # the whole run, not only its last epoch
    warm = step_times[5:] or step_times
    result = {
        "num_workers": args.num_workers,
        "steps": len(losses),
        "losses": losses,
        "first5": sum(losses[:5]) / min(5, len(losses)),
        "last5": sum(losses[-5:]) / min(5, len(losses)),
        "samples_per_s": args.batch_size * len(warm) / sum(warm),
        "step_s_median": sorted(warm)[len(warm) // 2],
        "data_wait_share": data_wait / sum(step_times),
        "first_batch_s": first_batch_s,
        "loader_to_first_batch_s": (model_ready - loader_built) + (first_batch_s or 0.0),
        "model_load_s": model_ready - loader_built,
        "total_s": time.perf_counter() - started,
        "peak_rss_bytes": peak,
        "samples": samples,
        "skipped": [{"index": s.index, "epoch": s.epoch, "error": f"{s.error_type}: {s.message}"}
                    for s in report.skipped],
        "adapter": os.path.abspath(args.output),
        "report": str(report),
    }
    print(str(report))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
