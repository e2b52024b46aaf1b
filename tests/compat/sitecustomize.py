"""Test-only: lets torchvision 0.28.0's pure-Python models import where its compiled ops cannot load.

The only torchvision 0.28.0 (the release matched to torch 2.13) that this project's machines
can install offline is the CUDA build from PyPI; its extension links CUDA torch libraries
that the CPU build of torch lacks, so it does not load, and ``import torchvision`` then fails
on two unguarded ``register_fake`` calls ("operator torchvision::nms does not exist"), although
the models (ResNet and the rest) are plain PyTorch and need none of its ops. On a machine
with torchvision's CPU wheel nothing here runs. Put this directory on PYTHONPATH to use it.

It acts lazily, when something first imports torchvision, and only on that exact failure:
it defines the two operator schemas (no kernels) and imports torchvision again.
"""

import importlib.abc
import sys


class _Torchvision(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" or self.busy:
            return None
        self.busy = True
        try:
            try:
                import torchvision  # the real import, once
            except RuntimeError as exc:
                if "torchvision::nms does not exist" not in str(exc):
                    raise
                for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
                    del sys.modules[mod]
                import torch

                for op in ("nms", "qnms"):
                    torch.library.define(f"torchvision::{op}",
                                         "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                import torchvision  # noqa: F401
        finally:
            self.busy = False
        return sys.modules["torchvision"].__spec__


sys.meta_path.insert(0, _Torchvision())
