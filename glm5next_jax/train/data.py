"""Training data: JSON lines of text, checked and tokenized before any step, then packed into rows.

Each line holds one JSON object whose `field` (default "text") is a string: one document, tokenized
and ended by the end-of-sequence id. A line that cannot be used is skipped and counted by its reason
(not UTF-8, empty, not JSON, without the field's string, longer than a row); `read_documents`
refuses a file that leaves no document. `pack_rows` packs whole documents into rows, in order, a
document going to a new row when it does not fit in what is left of the current one; each row's
`segment_ids` number its documents (0 for the padding at its end), as `forward` takes them.
"""

from __future__ import annotations

import collections
import json
import os
from typing import NamedTuple

import numpy as np

from ..errors import InputError


class Documents(NamedTuple):
    tokens: list  # one int32 array a document, ending with the end-of-sequence id
    lines: int  # lines read
    skipped: dict  # reason -> lines skipped for it


def read_documents(path, tokenizer, *, eos_id: int, max_tokens: int, field: str = "text") -> Documents:
    """The documents of a JSON-lines file, tokenized by `tokenizer` (a `tokenizers.Tokenizer`), each
    at most `max_tokens` ids with its end-of-sequence id."""
    if not os.path.isfile(path):
        raise InputError(f"--data: no file at {path}")
    skipped = collections.Counter()
    tokens, lines = [], 0
    with open(path, "rb") as f:
        for raw in f:
            lines += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not UTF-8"] += 1
                continue
            if not line.strip():
                skipped["empty"] += 1
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped["not JSON"] += 1
                continue
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                skipped[f"no {field!r} string"] += 1
                continue
            ids = tokenizer.encode(text).ids + [eos_id]
            if len(ids) > max_tokens:
                skipped[f"over {max_tokens} tokens"] += 1
                continue
            tokens.append(np.asarray(ids, np.int32))
    if not tokens:
        reasons = ", ".join(f"{n} {why}" for why, n in skipped.items()) or "the file is empty"
        raise InputError(f"--data: {path} holds no usable document ({lines} lines: {reasons})")
    return Documents(tokens, lines, dict(skipped))


def pack_rows(documents, row_tokens: int, pad_id: int = 0):
    """(ids [rows, row_tokens] int32, segment_ids [rows, row_tokens] int32): the documents (each at
    most row_tokens ids) packed in order, whole."""
    rows, row, used = [], [], 0
    for doc in documents:
        if len(doc) > row_tokens:
            raise InputError(f"a document of {len(doc)} tokens does not fit in rows of {row_tokens}")
        if used + len(doc) > row_tokens:
            rows.append(row)
            row, used = [], 0
        row.append(doc)
        used += len(doc)
    rows.append(row)
    ids = np.full((len(rows), row_tokens), pad_id, np.int32)
    segments = np.zeros((len(rows), row_tokens), np.int32)
    for r, docs in enumerate(rows):
        start = 0
        for number, doc in enumerate(docs, 1):
            ids[r, start : start + len(doc)] = doc
            segments[r, start : start + len(doc)] = number
            start += len(doc)
    return ids, segments
