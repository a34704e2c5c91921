"""transformers Trainer and TRL SFTTrainer runs with steadyload, for tests/frameworks/test_transformers.py.

``python -m tests.frameworks.trainer_job OUT RUN...`` (one process), or
``torchrun --nproc_per_node=2 -m tests.frameworks.trainer_job OUT RUN...`` (gloo).

Each RUN trains a tiny GPT-2 (2 layers, hidden 32, vocabulary 100) on `Tokens` (token 0 of
sample i is i, token 1 is drawn in the worker, ``sample_seeds=True``) with 2 workers and
writes OUT/<RUN>-rank<r>.json: the batches each step saw, every sample load (index, pid,
parent pid), the restarts, what the loader was built with, and any steadyload warning.

- ``A``: the mixin, STEPS steps uninterrupted, then ``evaluate()`` (the eval loader).
- ``B1``: as A, with a worker SIGKILLed after step KILL_STEP (on rank 1 when distributed)
  and a checkpoint at step SAVE_AT, mid-epoch; ``B2`` resumes from that checkpoint.
- ``B3``: resumes B1's checkpoint without the loader state file (skipping by index).
- ``B4``: in one process, resumes the checkpoint B1 wrote with 2 processes (elastic
  resume: the rest of that epoch, dealt to one rank).
- ``U1``/``U2``: the same pair (no kill) for a Trainer subclass with the mixin whose own
  ``get_train_dataloader`` returns a steadyload loader; ``W`` resumes U1's checkpoint with
  the subclass *without* the mixin; ``U3`` resumes it without the loader state file.
- ``S1``/``S2``: TRL's SFTTrainer with the mixin on a pre-tokenized ``datasets.Dataset``,
  fault-free and with a worker SIGKILLed after step KILL_STEP.
- ``K``: as B1 with the Trainer's default ``dataloader_persistent_workers=False`` (a new
  iterator each epoch): ``steadyload_report()`` after train() still shows epoch 0's restart.
  Its worker is killed after step K_KILL_STEP: at step KILL_STEP accelerate (a batch ahead)
  and the prefetch have sent worker 0 its last task of the epoch, which a busy machine lets
  it finish before the kill, so no task of its would be lost and nothing restarted.
- ``R1``/``R2``: as A (with a checkpoint at SAVE_AT) and its resume, with 1 local worker
  and 2 remote workers (Ray actors; ``RAY_ADDRESS`` names the cluster).
- The ledger: A records it through ``steadyload_options={"ledger": OUT/ledger-A}`` (its
  eval loader must not), B1/B2 and U1/U2 through ``STEADYLOAD_LEDGER`` (OUT/ledger-B,
  OUT/ledger-U), B4 into OUT/ledger-B4, a copy of B1's segments of OUT/ledger-B.
- ``E``: the mixin's errors (an unknown option, transformers without skip_first_batches) and
  whether the resume patch is in place during train() and gone after an exception.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import steadyload

if __name__ == "__main__":
    # As docs/guide/fork-safety.md advises, first thing: the fork server imports what the
    # workers need (the Trainer's collator wrapper and seed_worker, TRL's collator) while this
    # process imports transformers too.
    steadyload.prestart(["torch", "tests.frameworks.hf_common",
                         "transformers.trainer_utils", "trl.trainer.sft_trainer"])

import psutil  # noqa: E402
import torch  # noqa: E402

from steadyload.integrations.accelerate import steadyload_base  # noqa: E402
from steadyload.integrations.transformers import SteadyloadTrainerMixin  # noqa: E402
from steadyload.resume.ledger.files import read_folder  # noqa: E402
from tests.frameworks.hf_common import (  # noqa: E402
    VOCAB,
    Tokens,
    batch_key,
    forkserver_pid,
    kill_worker,
    read_loads,
    tiny_gpt2,
)

N, BATCH = 32, 4
DDP = int(os.environ.get("WORLD_SIZE", "1")) > 1
STEPS_PER_EPOCH = N // BATCH // (2 if DDP else 1)
SAVE_AT = STEPS_PER_EPOCH + 2  # mid-epoch 1
STEPS = min(SAVE_AT + 3, 2 * STEPS_PER_EPOCH)  # a resume stays in epoch 1
KILL_STEP = 2
K_KILL_STEP = 1  # see K above
OPTIONS = {"sample_seeds": True, "max_restarts": 2}
LEDGER_ENV = {  # the runs with STEADYLOAD_LEDGER=OUT/<folder>
    "B1": "ledger-B",
    "B2": "ledger-B",
    "B4": "ledger-B4",
    "U1": "ledger-U",
    "U2": "ledger-U",
}


def _args(out: Path, run: str, **extra: Any) -> Any:
    from transformers import TrainingArguments

    base: dict[str, Any] = dict(
        output_dir=str(out / run.rstrip("0123456789")), per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, max_steps=STEPS, save_strategy="steps",
        save_steps=SAVE_AT, logging_steps=1000, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=2, dataloader_persistent_workers=True,
        dataloader_prefetch_factor=2, dataloader_pin_memory=False,
    )
    if DDP:
        base["ddp_backend"] = "gloo"
    base.update(extra)
    return TrainingArguments(**base)


def _probe(record: dict[str, Any], kill: bool, kill_step: int = KILL_STEP) -> Any:
    """A callback: SIGKILL a worker after ``kill_step``, collect restarts and worker parents."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            loader = kw["train_dataloader"]
            record.setdefault("step_s", []).append(round(time.monotonic() - record.get("t0", 0), 3))
            record["loader_type"] = f"{type(loader).__module__}.{type(loader).__name__}"
            base = steadyload_base(loader)
            if base is None:
                return
            for w in base.report().workers:
                try:
                    record["worker_ppids"].add(psutil.Process(w.pid).ppid())
                except (psutil.Error, TypeError):
                    pass
            if kill and state.global_step == kill_step and (not DDP or args.process_index == 1):
                record["killed"] = kill_worker(loader)

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            base = steadyload_base(kw["train_dataloader"])
            if base is not None:  # each epoch's restarts, at its end
                record["restarts"] |= {(r.pid, r.cause) for r in base.report().restarts}

        on_train_end = on_epoch_end

    return Probe()


def _recording(record: dict[str, Any]) -> type:
    class Recording:
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            if "first_batch_s" not in record:
                record["first_batch_s"] = time.monotonic() - record["t0"]
            if model.training:  # not evaluate()'s batches
                record["batches"].append(batch_key(inputs["input_ids"]))
            return super().compute_loss(model, inputs, *a, **k)  # type: ignore[misc]

    return Recording


def trainer_run(out: Path, run: str) -> dict[str, Any]:
    from transformers import Trainer

    logs = out / f"loads-{run}-{os.environ.get('RANK', '0')}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    record: dict[str, Any] = {"batches": [], "restarts": set(), "worker_ppids": set()}
    Recording = _recording(record)
    user_way = run[0] in "UW"

    class UserTrainer(Trainer):  # type: ignore[misc]
        """The way people write it today: their own loader from get_train_dataloader."""

        def get_train_dataloader(self) -> Any:
            return steadyload.DataLoader(
                self.train_dataset, batch_size=BATCH, shuffle=True, num_workers=2,
                collate_fn=self.data_collator, persistent_workers=True, **OPTIONS)

    if run == "W":
        cls: type = type("T", (Recording, UserTrainer), {})
    elif user_way:
        cls = type("T", (Recording, SteadyloadTrainerMixin, UserTrainer), {})
    else:
        cls = type("T", (Recording, SteadyloadTrainerMixin, Trainer), {})
    kwargs = {} if run == "W" else {"steadyload_options": OPTIONS}
    if run == "A":  # the ledger from the one argument
        kwargs = {"steadyload_options": {**OPTIONS, "ledger": str(out / "ledger-A")}}
    if run[0] == "R":  # 1 local worker + 2 Ray actors (RAY_ADDRESS names the cluster)
        kwargs = {"steadyload_options": {**OPTIONS, "remote_workers": 2}}
    eval_logs = out / f"eval-{run}-{os.environ.get('RANK', '0')}"
    eval_logs.mkdir(exist_ok=True)
    extra: dict[str, Any] = {"dataloader_persistent_workers": False} if run == "K" else {}
    if run[0] == "R":
        extra["dataloader_num_workers"] = 1
    kill_step = K_KILL_STEP if run == "K" else KILL_STEP
    trainer = cls(model=tiny_gpt2(), args=_args(out, run, **extra),
                  train_dataset=Tokens(N, str(logs)),
                  eval_dataset=Tokens(16, str(eval_logs)) if run == "A" else None,
                  callbacks=[_probe(record, run in ("B1", "K"), kill_step)], **kwargs)
    resume = None
    if run in ("B2", "B3", "U2", "U3", "W", "R2"):
        resume = str(out / run[0].replace("W", "U") / f"checkpoint-{SAVE_AT}")
    if run == "B4":  # B1's checkpoint from 2 processes: its SAVE_AT
        resume = str(out / "B" / f"checkpoint-{N // BATCH // 2 + 2}")
    if run in ("B3", "U3"):  # resume by index, without the loader's state (in a copy)
        copy = out / f"{run}-checkpoint-rank{os.environ.get('RANK', '0')}"  # each rank its own
        resume = str(shutil.copytree(resume, copy, dirs_exist_ok=True))
        for name in os.listdir(resume):
            if name.startswith("steadyload_loader"):
                os.remove(os.path.join(resume, name))
    if run in LEDGER_ENV:
        _ledger_env(out, run)
    record["t0"] = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            os.environ.pop("STEADYLOAD_LEDGER", None)
    record["warnings"] = [str(w.message) for w in caught if "steadyload" in str(w.message)]
    record["train_s"] = time.monotonic() - record.pop("t0")
    if run[0] == "R":  # which workers served the last epoch (remote ones name their node)
        record["report"] = str(steadyload_base(trainer.callback_handler.train_dataloader).report())
    loader = trainer.callback_handler.train_dataloader
    base = steadyload_base(loader)
    if base is not None:
        record["built_with"] = {
            "collate_fn": type(base.collate_fn).__name__,
            "worker_init_fn": getattr(base.worker_init_fn, "func", base.worker_init_fn).__name__
            if base.worker_init_fn else None,
            "batch_sampler": type(base.batch_sampler).__name__,
            "prefetch_factor": base.prefetch_factor,
            "persistent_workers": base.persistent_workers,
            "options": {k: getattr(base, k) for k in OPTIONS},
            "report_start_method": loader.report().start_method,
        }
        mixin_report = trainer.steadyload_report() if hasattr(trainer, "steadyload_report") else None
        record["mixin_report_batches"] = [mixin_report.batches if mixin_report else None,
                                          loader.report(all_epochs=True).batches,
                                          loader.report().batches]
        if mixin_report is not None:  # after train(): every epoch's restarts, with the epoch
            record["mixin_report"] = {
                "epochs": mixin_report.epochs,
                "restarts": [[r.cause, r.epoch] for r in mixin_report.restarts],
                "latest_epoch_restarts": len(loader.report().restarts),
            }
    if run == "A":
        eval_loader = trainer.get_eval_dataloader()
        metrics = trainer.evaluate()
        eval_base = steadyload_base(eval_loader)
        record["eval"] = {
            "loader_type": f"{type(eval_loader).__module__}.{type(eval_loader).__name__}",
            "steadyload": eval_base is not None,
            "cached": trainer.get_eval_dataloader() is eval_loader,
            "loss": metrics["eval_loss"],
            "parents": sorted({ppid for _, _, ppid in read_loads(eval_logs)}),
            "start_method": eval_base.report().start_method if eval_base else None,
            "ledger": eval_base.ledger if eval_base else "not steadyload's",
        }
    if run in ("B1", "U1"):
        folder = Path(_args(out, run).output_dir) / f"checkpoint-{SAVE_AT}"
        record["checkpoint"] = sorted(os.listdir(folder))
    record["loads"] = read_loads(logs)
    record["main_pid"] = os.getpid()
    del trainer, loader, base
    gc.collect()  # persistent workers end with their loader
    return record


def _ledger_env(out: Path, run: str) -> None:
    """STEADYLOAD_LEDGER for ``run``. B4's folder: a copy of B1's segments (in OUT/ledger-B,
    B2 resumed the same checkpoint: B4 would be a second launch of that resume there)."""
    folder = out / LEDGER_ENV[run]
    if run == "B4":
        folder.mkdir()
        for segment in read_folder(out / "ledger-B"):
            if segment.header["parent"] is None:
                shutil.copy(segment.path, folder)
    os.environ["STEADYLOAD_LEDGER"] = str(folder)


def errors_run(out: Path, run: str) -> dict[str, Any]:
    """The mixin's loud failures, and the resume patch's life span (no workers: quick)."""
    import transformers.trainer as tt
    from transformers import Trainer, TrainerCallback

    record: dict[str, Any] = {"batches": [], "restarts": set(), "worker_ppids": set()}
    original = tt.skip_first_batches

    class T(SteadyloadTrainerMixin, Trainer):  # type: ignore[misc]
        pass

    def build(**kw: Any) -> Any:
        args = _args(out, run, dataloader_num_workers=0, dataloader_persistent_workers=False,
                     dataloader_prefetch_factor=None, save_strategy="no")
        return T(model=tiny_gpt2(), args=args, train_dataset=Tokens(N), **kw)

    try:
        build(steadyload_options={"on_eror": "skip"})
    except TypeError as exc:
        record["unknown_option"] = str(exc)

    class Boom(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            record["patched_during_train"] = tt.skip_first_batches is not original
            raise RuntimeError("boom")

    trainer = build()
    trainer.add_callback(Boom())
    try:
        trainer.train()
    except RuntimeError as exc:
        record["raised"] = str(exc)
    record["restored_after_exception"] = tt.skip_first_batches is original
    del tt.skip_first_batches  # a transformers release without it
    try:
        build()
    except RuntimeError as exc:
        record["missing_name"] = str(exc)
    finally:
        tt.skip_first_batches = original
    record["main_pid"] = os.getpid()
    return record


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 4)}
    vocab |= {"<pad>": VOCAB - 4, "<eos>": VOCAB - 3, "<bos>": VOCAB - 2, "<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def sft_run(out: Path, run: str) -> dict[str, Any]:
    import datasets
    from trl import SFTConfig, SFTTrainer

    record: dict[str, Any] = {"batches": [], "restarts": set(), "worker_ppids": set()}

    class T(_recording(record), SteadyloadTrainerMixin, SFTTrainer):  # type: ignore[misc]
        pass

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": [i] + torch.randint(0, VOCAB - 4, (int(torch.randint(4, 12, (), generator=g)),),
                                               generator=g).tolist()} for i in range(N)]
    args = SFTConfig(output_dir=str(out / "S"), max_steps=STEPS_PER_EPOCH + 2,
                     per_device_train_batch_size=BATCH, report_to=[], use_cpu=True,
                     dataloader_num_workers=2, logging_steps=1000, save_strategy="no",
                     disable_tqdm=True, max_length=32, dataloader_pin_memory=False, seed=0,
                     dataloader_persistent_workers=True)  # epoch 1 needs the killed worker
    trainer = T(model=tiny_gpt2(), args=args, train_dataset=datasets.Dataset.from_list(rows),
                processing_class=_tokenizer(), callbacks=[_probe(record, kill=run == "S2")],
                steadyload_options={"max_restarts": 2})
    record["mro"] = [c.__name__ for c in type(trainer).__mro__][:5]
    record["t0"] = time.monotonic()
    trainer.train()
    record["train_s"] = time.monotonic() - record.pop("t0")
    loader = trainer.callback_handler.train_dataloader
    base = steadyload_base(loader)
    record["collator"] = f"{type(base.collate_fn).__module__}.{type(base.collate_fn).__name__}"
    record["report_start_method"] = loader.report().start_method
    record["report"] = str(loader.report())
    record["main_pid"] = os.getpid()
    del trainer, loader, base
    gc.collect()
    return record


def main() -> None:
    warnings.filterwarnings("ignore")  # framework chatter; steadyload's are recorded per run
    out = Path(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    for run in sys.argv[2:]:
        runner = {"S": sft_run, "E": errors_run}.get(run[0], trainer_run)
        record = runner(out, run)
        record.update(forkserver=forkserver_pid(), worker_ppids=sorted(record["worker_ppids"]),
                      restarts=sorted(cause for _, cause in record["restarts"]),
                      steps_per_epoch=STEPS_PER_EPOCH, save_at=SAVE_AT, steps=STEPS)
        (out / f"{run}-rank{rank}.json").write_text(json.dumps(record))
    # Everything the runs started has ended (persistent workers included).
    fs = forkserver_pid()
    left = [p.pid for p in psutil.Process(fs).children()] if fs else []
    (out / f"leftover-rank{rank}.json").write_text(json.dumps(left))


if __name__ == "__main__":
    main()
