"""Offline stand-ins for Qwen2.5-VL-7B-Instruct: a tiny random model, its processor, and data.

Run: python tiny_vlm.py MODEL_DIR DATA_DIR [--samples N] [--bad-lines]

Nothing is downloaded. The processor is a byte-level BPE tokenizer trained here, with the
Qwen special tokens and chat template, plus the Qwen2-VL image processor; the model is a
`Qwen2_5_VLForConditionalGeneration` with about 200k random parameters. The data are
640x480 JPEG photos of coloured shapes with a question and an answer per JSONL line, so
that decoding and resizing an image costs real CPU time, as with real photos.

`load_processor(path)` is what the training script calls in each worker: the stock
`AutoProcessor` where it works (a real checkpoint with torchvision installed), else the
image-only subclass below. transformers >= 4.52 insists on a torchvision video processor
even for images, and torchvision cannot be installed beside the CPU build of torch 2.13.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

from transformers import AutoProcessor, Qwen2_5_VLProcessor

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220),
           "yellow": (230, 210, 20)}


class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
    """The Qwen2.5-VL processor without the (torchvision) video processor: images and text."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _have_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


if not _have_torchvision():
    # Without torchvision, AutoProcessor must build the image-only processor for Qwen2.5-VL
    # (the stock one would fail, or fall back to returning just the tokenizer).
    from transformers import Qwen2_5_VLConfig

    AutoProcessor.register(Qwen2_5_VLConfig, Qwen2_5_VLImageOnlyProcessor, exist_ok=True)


def load_processor(path: str) -> Any:
    """The processor saved in ``path`` (stock with torchvision, else image-only).

    Raises:
        TypeError: the directory does not hold a multimodal processor.
    """
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise TypeError(
            f"{path} holds no image+text processor (AutoProcessor returned "
            f"{type(processor).__name__}); build it with tiny_vlm.py or use a Qwen2.5-VL "
            "checkpoint directory"
        )
    return processor


def build_tiny_vlm(out: str, seed: int = 0) -> None:
    """Write a tiny random Qwen2.5-VL model (weights from ``seed``) and its processor."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Tokenizer,
        Qwen2VLImageProcessorPil,
    )

    corpus = ["What colour is the shape? The square is red. The circle is blue, green, yellow.",
              "You are a helpful assistant. system user assistant"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    m = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=m["vocab"], merges=[tuple(p) for p in m["merges"]], unk_token=None,
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    image_proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)  # 4..16 tokens
    Qwen2_5_VLImageOnlyProcessor(image_proc, tok, chat_template=CHAT_TEMPLATE).save_pretrained(out)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)  # the same "random" model every time: reproducible losses
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(out)


def make_dataset(out: str, n: int = 64, seed: int = 0, bad_lines: bool = False,
                 size: tuple[int, int] = (640, 480)) -> None:
    """Write ``n`` JPEG photos of shapes and ``train.jsonl`` (question, answer) to ``out``.

    With ``bad_lines``, two broken lines are added: one names a missing image, one is not
    JSON; the training script must skip them and say so.
    """
    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(seed)
    os.makedirs(f"{out}/images", exist_ok=True)
    lines = []
    for i in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(["square", "circle"])
        w, h = size
        # Noise and a blur make the JPEG compress like a photo, not like flat colour.
        img = Image.effect_noise((w, h), 40).convert("RGB")
        draw = ImageDraw.Draw(img)
        box = (w // 4 + rng.randint(-40, 40), h // 4 + rng.randint(-30, 30),
               3 * w // 4 + rng.randint(-40, 40), 3 * h // 4 + rng.randint(-30, 30))
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
        img.filter(ImageFilter.GaussianBlur(1)).save(f"{out}/images/{i:04d}.jpg", quality=90)
        lines.append(json.dumps({"image": f"images/{i:04d}.jpg",
                                 "question": "What colour is the shape?",
                                 "answer": f"The {shape} is {colour}."}))
    if bad_lines:
        missing = {"image": "images/missing.jpg", "question": "?", "answer": "!"}
        lines.insert(3, json.dumps(missing))
        lines.insert(7, '{"image": "images/0001.jpg", "question": ')
    Path(f"{out}/train.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--bad-lines", action="store_true")
    args = ap.parse_args()
    build_tiny_vlm(args.model_dir)
    make_dataset(args.data_dir, args.samples, bad_lines=args.bad_lines)
