"""Seeds derived from simple values, the same in every process and every run.

Everything random in the data pipeline is a pure function of (seed, epoch, index), never of how many batches came
before: what makes resume exact (a run that restarts at epoch E, batch K regenerates epoch E's order and sees the
same crops, flips and captions it would have seen)."""
from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A stable 64-bit seed from any tuple of simple values.

    Python's hash() of strings changes between processes, so a resumed run
    would draw different numbers; sha256 does not.
    """
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")
