"""Dataset handling: folder scan and image checks (scan.py, images.py), captions, buckets, seeds, the batch order
(order.py), examples (examples.py), the DataLoader (loader.py) and caches (caches.py).

Import from here; the submodules are an implementation detail.
"""

from .buckets import assign_bucket, crop_geometry, make_buckets, resize_and_crop, training_buckets
from .caches import EmbeddingCache, LatentCache, NonFiniteCacheError, check_finite, module_fingerprint
from .captions import process_caption
from .examples import DatasetView, Placement, collate
from .images import IMAGE_EXTENSIONS, UnreadableImageError, load_image
from .loader import BatchFeed
from .order import BucketBatchSampler, ShardedBatchSampler
from .scan import DataItem, DatasetError, DatasetScan, SkippedFile, scan_dataset, write_caption
from .seeds import derive_seed

__all__ = [
    "IMAGE_EXTENSIONS",
    "BatchFeed",
    "BucketBatchSampler",
    "DataItem",
    "DatasetError",
    "DatasetScan",
    "DatasetView",
    "EmbeddingCache",
    "LatentCache",
    "NonFiniteCacheError",
    "Placement",
    "ShardedBatchSampler",
    "SkippedFile",
    "UnreadableImageError",
    "assign_bucket",
    "check_finite",
    "collate",
    "crop_geometry",
    "derive_seed",
    "load_image",
    "make_buckets",
    "module_fingerprint",
    "process_caption",
    "resize_and_crop",
    "scan_dataset",
    "training_buckets",
    "write_caption",
]
