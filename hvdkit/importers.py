"""Real data with no download: images that ship inside scikit-learn and text on every machine.

* :func:`import_digits`: scikit-learn's 1,797 handwritten digits (8x8, 10 classes; 1,797
  real scans from the UCI collection, inside the package), as ``train.h5`` and ``val.h5``
  with a fixed split of 300 held-out images; optionally upsampled and in 3 channels, for
  image models built for larger inputs (ResNet).
* :func:`import_text`: a character-level corpus of the Python standard library's own source
  (the top-level ``*.py`` modules of the running interpreter, in sorted order), windows of
  ``block + 1`` characters for a language model. The validation set is the corpus's last
  10%: whole modules the model never trains on (a split by position, not by random
  windows, which would leak overlapping text into validation).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .data import split_indices, write_h5_dataset
from .errors import ConfigError, HvdkitError

__all__ = ["import_digits", "import_text", "stdlib_corpus", "DIGITS_VAL"]

DIGITS_VAL = 300  # held-out digits (of 1,797): a sixth, fixed by seed 0


def import_digits(directory: str | Path, image_size: int = 8, channels: int = 1) -> dict[str, Any]:
    """Write ``train.h5`` and ``val.h5`` (x float32 (N, C, S, S) in [0, 1], y int64) to ``directory``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise HvdkitError("the digits come with scikit-learn, which is not installed",
                          "pip install 'hvdkit[examples]' (or scikit-learn)") from None
    if image_size < 8 or channels not in (1, 3):
        raise ConfigError(f"--image-size {image_size} / --channels {channels}", "image size >= 8, channels 1 or 3")
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8), pixel values were 0..16
    if image_size != 8:
        import torch

        x = torch.nn.functional.interpolate(torch.from_numpy(x), size=(image_size, image_size),
                                            mode="bilinear", align_corners=False).numpy()
    if channels == 3:
        x = np.repeat(x, 3, axis=1)
    y = digits.target.astype(np.int64)
    train, val = split_indices(len(y), DIGITS_VAL / len(y), seed=0)
    out = Path(directory)
    attrs = {"source": "sklearn.datasets.load_digits", "image_size": image_size, "channels": channels}
    write_h5_dataset(out / "train.h5", x[train], y[train], {**attrs, "split": "train"})
    write_h5_dataset(out / "val.h5", x[val], y[val], {**attrs, "split": "val"})
    return {"train": len(train), "val": len(val), "shape": list(x.shape[1:]), "classes": 10,
            "directory": str(out)}


def stdlib_corpus(max_bytes: int) -> tuple[str, list[str]]:
    """The text of the standard library's top-level modules, sorted by name, up to ``max_bytes``.

    Returns the text and the module files used (whole files only).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise HvdkitError(f"no standard library sources in {stdlib}", "run with a Python that has its .py files")
    parts, used, size = [], [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if size and size + len(text) > max_bytes:
            break
        parts.append(text)
        used.append(path.name)
        size += len(text)
    return "".join(parts), used


def import_text(directory: str | Path, block: int = 64, max_bytes: int = 1_500_000,
                val_fraction: float = 0.1) -> dict[str, Any]:
    """Write ``train.h5`` and ``val.h5`` of character windows (x: (N, block+1) token ids).

    Also returns (and stores as attributes) the vocabulary and two baselines in nats per
    character: the unigram entropy of the training text, and the cross-entropy of that
    unigram model on the validation text (what a model that ignores context scores).
    """
    if block < 2:
        raise ConfigError(f"--block {block} is too short", "use a block of at least 2 characters")
    text, used = stdlib_corpus(max_bytes)
    vocab = sorted(set(text))
    if len(vocab) > 65535:
        raise HvdkitError("the corpus has more than 65535 distinct characters", "use less text")
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = np.fromiter((index[ch] for ch in text), dtype=np.uint8 if len(vocab) <= 256 else np.uint16,
                      count=len(text))
    cut = int(len(ids) * (1 - val_fraction))
    train_ids, val_ids = ids[:cut], ids[cut:]
    counts = Counter(train_ids.tolist())
    total = sum(counts.values())
    entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    floor = 0.5 / total  # a character unseen in training gets half a count
    val_xent = -float(np.mean([math.log(counts.get(int(t), floor * total) / total) for t in val_ids]))
    window = block + 1

    def windows(stream: np.ndarray) -> np.ndarray:
        n = len(stream) // window
        return stream[: n * window].reshape(n, window).astype(np.int64 if stream.dtype == np.uint16 else np.uint8)

    attrs = {"source": f"Python {sys.version.split()[0]} standard library, {len(used)} top-level modules "
                       f"({used[0]} .. {used[-1]})",
             "vocab": json.dumps(vocab), "vocab_size": len(vocab), "block": block,
             "sha256": hashlib.sha256(text.encode()).hexdigest(),
             "unigram_entropy_nats": entropy, "unigram_val_xent_nats": val_xent}
    out = Path(directory)
    train, val = windows(train_ids), windows(val_ids)
    if len(val) == 0:
        raise ConfigError("the validation text is shorter than one window", "use a smaller --block or more text")
    write_h5_dataset(out / "train.h5", train, None, {**attrs, "split": "train"})
    write_h5_dataset(out / "val.h5", val, None, {**attrs, "split": "val"})
    return {"train": len(train), "val": len(val), "vocab_size": len(vocab), "block": block,
            "characters": len(text), "modules": len(used), "unigram_entropy_nats": round(entropy, 4),
            "unigram_val_xent_nats": round(val_xent, 4), "directory": str(out)}
