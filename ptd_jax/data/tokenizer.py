"""Byte-level tokenizer: token i < 256 is byte i, token 256 is end-of-document (EOD).

No vocabulary file, no download: every text has a lossless encoding. The model pads the vocabulary (257) to a
multiple of 128·t (Megatron's --make-vocab-size-divisible-by); padded ids are never produced here.
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    name = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")
