"""LoRA fine-tuning of Qwen2.5-VL with the transformers Trainer on steadyload's workers.

The recipe of train.py (its dataset class, collate function and processor, imported from
there, and the same LoRA setup), with the hand-written loop replaced by a ``Trainer``. Run
it the same way (after `python tiny_vlm.py MODEL DATA`, or with a real checkpoint directory):

    python train_trainer.py --model MODEL --dataset DATA --num-workers 2 --steps 20 --output adapter

What steadyload changes in a Trainer script is one line and one argument:

    class Trainer(SteadyloadTrainerMixin, transformers.Trainer): ...   # the mixin first
    trainer = Trainer(..., steadyload_options={"on_error": "skip"})

The Trainer builds the loader from its ``dataloader_*`` arguments as usual (2 workers,
persistent, prefetch 2, shuffled by its seeded sampler); the mixin keeps it on
steadyload's forkserver workers, so the two broken lines are skipped and listed instead of
ending the run, a dead worker is replaced, ``trainer.steadyload_report()`` says what the
workers did, and checkpoints carry the loader's position for an exact mid-epoch resume.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import sys
import time
from typing import Any

import steadyload as sl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    # First thing, as in train.py: the fork server imports what the workers need (the
    # dataset's module and the Trainer's seed_worker) while this process imports them too.
    sl.prestart(["torch", "PIL.Image", "tiny_vlm", "train",
                 "transformers.trainer_utils"])

import torch  # noqa: E402
from train import VLMJSONLDataset, _memory, arguments, collate  # noqa: E402  (beside this file)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train with a Trainer; print and return the results (as train.py's, same keys)."""
    args = arguments(argv, __doc__)

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    dataset = VLMJSONLDataset(os.path.join(args.dataset, "train.jsonl"), args.model)

    import psutil
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration, TrainerCallback

    from steadyload.integrations.transformers import SteadyloadTrainerMixin

    class Trainer(SteadyloadTrainerMixin, transformers.Trainer):
        """The stock Trainer, its loaders on steadyload's workers."""

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, local_files_only=True)
    model = get_peft_model(model, LoraConfig(
        r=args.lora_r, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))  # the language model only
    model_ready = time.perf_counter()

    steps: list[tuple[float, float]] = []  # (begin, end) of each step, perf_counter
    peak = [0]
    parents: set[int] = set()  # of the workers: steadyload's fork server

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append((time.perf_counter(), 0.0))

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            steps[-1] = (steps[-1][0], time.perf_counter())
            report = trainer.steadyload_report()
            pids = [w.pid for w in report.workers if w.pid] if report else []
            peak[0] = max(peak[0], _memory(pids))
            parents.update(psutil.Process(pid).ppid() for pid in pids if psutil.pid_exists(pid))

    workers = dict(dataloader_persistent_workers=True, dataloader_prefetch_factor=2)
    training_args = transformers.TrainingArguments(
        output_dir=args.output + "-trainer", max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        lr_scheduler_type="constant", weight_decay=0.0, seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=args.num_workers,
        dataloader_pin_memory=torch.cuda.is_available(),
        remove_unused_columns=False,  # collate returns exactly the model's inputs
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        **(workers if args.num_workers > 0 else {}),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                      data_collator=collate, callbacks=[Timing()],
                      steadyload_options={"on_error": "skip"})
    train_started = time.perf_counter()
    trainer.train()
    model.save_pretrained(args.output)  # the LoRA adapter only
    report = trainer.steadyload_report()
    assert report is not None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    durations = [end - begin for begin, end in steps]
    warm = steps[5:] or steps
    # A step here is the Trainer's forward/backward/optimizer step; the wait for its batch
    # falls between two steps, so throughput is measured over the warm steps' span.
    span = warm[-1][1] - warm[0][0]
    result = {
        "num_workers": args.num_workers,
        "steps": len(losses),
        "losses": losses,
        "first5": sum(losses[:5]) / min(5, len(losses)),
        "last5": sum(losses[-5:]) / min(5, len(losses)),
        "samples_per_s": args.batch_size * len(warm) / span,
        "step_s_median": sorted(durations[5:] or durations)[len(durations[5:] or durations) // 2],
        "data_wait_share": report.data_stall_share,
        "first_batch_s": steps[0][0] - train_started,
        "loader_to_first_batch_s": steps[0][0] - model_ready,
        "total_s": time.perf_counter() - started,
        "peak_rss_bytes": peak[0],
        "worker_parents": sorted(parents),
        "fork_server_pid": multiprocessing.forkserver._forkserver._forkserver_pid,
        "pid": os.getpid(),
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
