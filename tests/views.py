"""Test helper: a DatasetView from a scan and a few data options (a TrainConfig with those, defaults elsewhere)."""
from __future__ import annotations

from stabletune_core.config import build_config
from stabletune_core.data import DatasetScan, DatasetView


def view_of(scan: DatasetScan, resolution: int, *, random_crop: bool = False, flip: bool = False,
            **options) -> DatasetView:
    """`options` are TrainConfig data knobs (bucket_step, min_bucket_reso, enable_bucket, seed, ...); unlike the
    TrainConfig's defaults the crop is centred unless `random_crop`."""
    config = build_config({"resolution": resolution, "center_crop": not random_crop, "random_flip": flip,
                           "seed": 0, **options})
    return DatasetView(scan, config)
