"""Regularisation (class) images for prior preservation, the way kohya's sd-scripts mix them in.

The reg folder follows the training folder's rules (captions, `N_name` repeats). Each epoch sees as many reg
images as instance images (counting repeats): when the reg folder holds fewer, its images are cycled, one more
repeat at a time in folder order; when it holds more, only the first ones that fill the epoch are used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .scan import DataItem, DatasetScan, scan_dataset


def scan_reg_images(reg_dir: Path, instance_total: int, default_caption: str = "",
                    caption_extension: str = ".txt", *, masked_loss: bool = False) -> DatasetScan:
    """Scan `reg_dir` and set each reg item's repeats so one epoch holds `instance_total` of them."""
    scan = scan_dataset(Path(reg_dir), default_caption, caption_extension, masked_loss=masked_loss,
                        folder_words="Class-image folder (reg_data_dir)")  # its sentences name it as what it is
    scan.reg_dirs = folder_counts(scan.items, Path(reg_dir).expanduser())
    scan.items = balance_reg_items(scan.items, instance_total)
    return scan


def folder_counts(items: list[DataItem], root: Path) -> dict[str, dict[str, int]]:
    """{top-level folder: {"n_repeats", "img_count"}} (images directly in `root` under its own name)."""
    counts: dict[str, dict[str, int]] = {}
    for item in items:
        parts = item.path.relative_to(root).parts
        entry = counts.setdefault(parts[0] if len(parts) > 1 else root.name, {"n_repeats": item.repeats,
                                                                              "img_count": 0})
        entry["img_count"] += 1
    return counts


def balance_reg_items(items: list[DataItem], instance_total: int) -> list[DataItem]:
    """kohya's rule: walk the reg images in order, registering each with its folder repeats until the epoch
    holds `instance_total`; if one pass is not enough, keep walking, adding one repeat per image."""
    repeats: list[int] = []
    seen = 0
    while seen < instance_total:
        for i, item in enumerate(items):
            if len(repeats) < len(items):
                repeats.append(item.repeats)
                seen += item.repeats
            else:
                repeats[i] += 1
                seen += 1
            if seen >= instance_total:
                break
    return [dataclasses.replace(item, repeats=count, is_reg=True) for item, count in zip(items, repeats)]


def merge_reg(instance: DatasetScan, reg: DatasetScan) -> DatasetScan:
    """One scan holding the instance items then the reg items (the sampler mixes them into every batch)."""
    return DatasetScan(root=instance.root, items=instance.items + reg.items,
                       skipped=instance.skipped + reg.skipped, notes=instance.notes + reg.notes,
                       reg_dirs=reg.reg_dirs)
