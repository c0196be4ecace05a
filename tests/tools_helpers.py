"""Tiny captioners built locally for the tools' tests, and a read-only folder that holds even for root."""
from __future__ import annotations

import csv
import math
import os
import shutil
import stat
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# (name, category, what drives it): ("B"|"G"|"R", bias) reads that channel's mean (0-255) of the tagger's
# BGR input; a float is a constant probability. Ratings (9) first, as in the real selected_tags.csv.
TAGS = [
    ("general", 9, 0.8), ("sensitive", 9, 0.1), ("questionable", 9, 0.05), ("explicit", 9, 0.01),
    ("red_theme", 0, ("R", -10.0)), ("blue_theme", 0, ("B", -10.0)),
    ("green_theme", 0, ("G", -5.0)),  # only white padding gives a red or blue image green
    ("simple_background", 0, 0.6), ("^_^", 0, 0.9), ("long_hair", 0, 0.4),
    ("hero_(series)", 4, 0.9), ("villain", 4, 0.5),
]
CHANNEL = {"B": 0, "G": 1, "R": 2}


def build_wd14_tagger(folder: Path, input_name: str = "input_1") -> Path:
    """A WD14-layout tagger (NHWC BGR float 0-255, 448 x 448, sigmoid outputs, selected_tags.csv) whose
    predictions follow the image's colours, so tests can tell BGR from RGB and white padding from black."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    weight = torch.zeros(len(TAGS), 3)
    bias = torch.zeros(len(TAGS))
    for i, (_, _, drive) in enumerate(TAGS):
        if isinstance(drive, tuple):
            weight[i, CHANNEL[drive[0]]] = 0.05
            bias[i] = drive[1]
        else:
            bias[i] = math.log(drive / (1 - drive))

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(3, len(TAGS))
            with torch.no_grad():
                self.head.weight.copy_(weight)
                self.head.bias.copy_(bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, 448, 448, 3]
            return torch.sigmoid(self.head(x.mean(dim=(1, 2))))

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Tagger().eval(), (torch.zeros(1, 448, 448, 3),), str(folder / "model.onnx"), dynamo=False,
                          input_names=[input_name], output_names=["predictions_sigmoid"],
                          dynamic_axes={input_name: {0: "batch"}, "predictions_sigmoid": {0: "batch"}})
    with open(folder / "selected_tags.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["tag_id", "name", "category", "count"])
        for i, (name, category, _) in enumerate(TAGS):
            writer.writerow([100 + i, name, category, 1000 - i])
    return folder


VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "a photo of the red blue circle square on white".split()


def build_tiny_blip(folder: Path, seed: int = 0) -> Path:
    """A BLIP captioner with random weights, its processor and a BERT word-piece tokenizer made here."""
    import torch
    from transformers import (BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor,
                              BlipProcessor)

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab-source.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    tokenizer = BertTokenizer(str(vocab), model_max_length=32)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    vocab.unlink()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=40, bos_token_id=tokenizer.bos_token_id,
                pad_token_id=tokenizer.pad_token_id, sep_token_id=tokenizer.sep_token_id)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=8)
    torch.manual_seed(seed)
    model = BlipForConditionalGeneration(BlipConfig(text_config=text, vision_config=vision, projection_dim=32))
    model.save_pretrained(str(folder))
    BlipProcessor(BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer).save_pretrained(str(folder))
    return folder


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: what a tool must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder` made unwritable for this process: mode 0555, and for root (whom modes do not stop) the
    immutable attribute, which stops root too."""
    mode = folder.stat().st_mode
    os.chmod(folder, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    immutable = os.geteuid() == 0 and shutil.which("chattr") is not None
    if immutable:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        assert not os.access(folder, os.W_OK), "could not make the folder read-only on this file system"
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, mode)
