"""Progress over bytes, for reading and writing checkpoints of hundreds of GiB.

`progress` arguments take: "auto" (a tqdm bar on stderr, with bytes, rate and ETA, when stderr is a
terminal; nothing in a batch job or a pipe), True (the bar whatever stderr is), False or None
(nothing), or a callable(done_bytes, total_bytes) called as the work advances.
"""

from __future__ import annotations

import sys

from .errors import InputError


class ByteProgress:
    """`advance(n)` as n more bytes are done; a context manager that closes the bar."""

    def __init__(self, progress, total: int, label: str):
        self.total, self.done, self.call, self.bar = total, 0, None, None
        if callable(progress):
            self.call = progress
        elif progress is True or (progress == "auto" and sys.stderr.isatty()):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        elif progress not in (False, None, "auto"):
            raise InputError(f'progress must be "auto", True, False, None or a callable(done, total), got {progress!r}')

    def advance(self, n: int):
        if not n:
            return
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.call is not None:
            self.call(self.done, self.total)

    def __enter__(self):
        if self.call is not None:
            self.call(0, self.total)
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
