"""Dataset handling: folder scan and image checks, captions, buckets, caches.

Import from here; the submodules are an implementation detail.
"""

from .buckets import assign_bucket, crop_geometry, make_buckets, maybe_flip, resize_and_crop
from .captions import process_caption
from .dataset import (
    BucketBatchSampler,
    DatasetView,
    EmbeddingCache,
    LatentCache,
    NonFiniteCacheError,
    check_finite,
    collate,
    derive_seed,
)
from .images import IMAGE_EXTENSIONS, UnreadableImageError, load_image
from .scan import DataItem, DatasetError, DatasetScan, SkippedFile, scan_dataset, write_caption

__all__ = [
    "IMAGE_EXTENSIONS",
    "BucketBatchSampler",
    "DataItem",
    "DatasetError",
    "DatasetScan",
    "DatasetView",
    "EmbeddingCache",
    "LatentCache",
    "NonFiniteCacheError",
    "SkippedFile",
    "UnreadableImageError",
    "assign_bucket",
    "check_finite",
    "collate",
    "crop_geometry",
    "derive_seed",
    "load_image",
    "make_buckets",
    "maybe_flip",
    "process_caption",
    "resize_and_crop",
    "scan_dataset",
    "write_caption",
]
