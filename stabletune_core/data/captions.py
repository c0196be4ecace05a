"""Caption augmentation for comma-separated tag captions (booru / kohya style).

Shuffling tags stops the model from tying a concept to tag position; keeping
the first few tags fixed keeps the trigger word where the user put it;
dropping tags or whole captions teaches the model the concept without leaning
on any one word (and, for the whole caption, trains unconditional guidance).
"""

from __future__ import annotations

import random


def process_caption(
    caption: str,
    rng: random.Random,
    *,
    shuffle: bool,
    keep_tokens: int,
    caption_dropout: float,
    tag_dropout: float = 0.0,
) -> str:
    """Return the augmented caption; the same rng state gives the same result.

    The whole caption becomes "" with probability `caption_dropout` (drawn
    first). Otherwise the first `keep_tokens` tags stay in place and are never
    dropped; the rest are shuffled if `shuffle`, and each is dropped with
    probability `tag_dropout`. With every option off the caption is returned
    unchanged (not re-joined), so captions stay byte-identical to the files
    and text-embedding caches keyed on them stay valid.
    """
    if caption_dropout > 0 and rng.random() < caption_dropout:
        return ""
    if not shuffle and tag_dropout <= 0:
        return caption

    tags = [tag.strip() for tag in caption.split(",")]
    tags = [tag for tag in tags if tag]
    keep = max(0, keep_tokens)
    fixed, rest = tags[:keep], tags[keep:]
    if shuffle:
        rng.shuffle(rest)
    if tag_dropout > 0:
        rest = [tag for tag in rest if rng.random() >= tag_dropout]
    return ", ".join(fixed + rest)
