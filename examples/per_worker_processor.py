"""A tokenizer built once per worker with `steadyload.per_worker`, never pickled.

Run: python examples/per_worker_processor.py

The same pattern holds for a HuggingFace `AutoProcessor.from_pretrained(path)`, an LMDB or
h5py handle, or a database connection: write the factory as a class attribute, use the
attribute in `__getitem__`, and each worker builds its own on first use.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import steadyload as sl

BUILDS: Counter[int] = Counter()


def build_tokenizer() -> Tokenizer:
    """Stands in for AutoProcessor.from_pretrained(...): slow, heavy, per process."""
    vocab = {w: i for i, w in enumerate("[UNK] the a square circle is red blue green".split())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    BUILDS[os.getpid()] += 1
    return tokenizer


class Captions(torch.utils.data.Dataset[Any]):
    tokenizer = sl.per_worker(build_tokenizer)  # built on first use in each worker

    def __init__(self, captions: list[str]) -> None:
        self.captions = captions

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.tokenizer.encode(self.captions[i]).ids
        return {"ids": torch.tensor(ids), "builds_here": BUILDS[os.getpid()], "pid": os.getpid()}


if __name__ == "__main__":
    captions = [f"the {s} is {c}" for s in ("square", "circle") for c in ("red", "blue", "green")]
    loader = sl.DataLoader(Captions(captions * 4), batch_size=4, num_workers=2)
    seen: dict[int, int] = {}
    for batch in loader:
        for pid, builds in zip(batch["pid"].tolist(), batch["builds_here"].tolist(), strict=True):
            seen[pid] = builds
    print(f"first batch ids: {next(iter(loader))['ids'].tolist()}")
    print(f"tokenizer builds per worker: {seen}  (the main process built it "
          f"{BUILDS[os.getpid()]} times)")
