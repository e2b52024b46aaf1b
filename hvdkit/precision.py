"""Mixed precision: autocast for bf16/fp16 and, for fp16, a gradient scaler; and whether this
machine runs the lower precision natively.

The model's parameters and the optimizer stay in fp32; autocast runs the forward
pass in the lower precision where that is safe. fp16 needs loss scaling (its
range is small: gradients underflow); bf16 has fp32's range and needs none. The
order of scaler calls around the gradient reduction is backend knowledge and
lives in :meth:`hvdkit.backends.Backend.optimizer_step`.

On a CPU, autocast's matmuls go to oneDNN. Where oneDNN has no kernels for the dtype (bf16
needs AVX-512 or AVX2-VNNI-2, fp16 needs AVX512-FP16 or AVX2-VNNI-2), it falls back to
reference code that is several times *slower* than fp32: :func:`lowp_support` says so before
the first step, with the slowdown measured by ``benchmarks/cpu_precision.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import PRECISIONS

__all__ = ["PRECISIONS", "autocast", "make_scaler", "LowpSupport", "lowp_support", "cpu_flags"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# What oneDNN needs for kernels of each dtype (dnnl::impl::cpu::platform::has_data_type_support),
# as the CPU flags Linux shows in /proc/cpuinfo: any one group suffices.
_CPU_NEEDS = {
    "bf16": (("avx512bw", "avx512vl", "avx512dq"), ("avx_vnni", "avx_ne_convert")),
    "fp16": (("avx512_fp16",), ("avx_vnni", "avx_ne_convert")),
}
_CPU_NEEDS_TEXT = {"bf16": "AVX-512 (avx512bw/vl/dq) or AVX2-VNNI-2 (avx_ne_convert)",
                   "fp16": "AVX512-FP16 (avx512_fp16) or AVX2-VNNI-2 (avx_ne_convert)"}
# One process, one thread, the example char GPT (1.2M parameters, 32 x 32 tokens), as a
# multiple of fp32's step time where oneDNN has no kernels for the dtype. Measured by
# benchmarks/cpu_precision.py (docs/bench/precision/): a Xeon with AMX capped at AVX2
# (ONEDNN_MAX_CPU_ISA) 18.05x bf16, 24.28x fp16 (natively 1.2x and 1.7x); an AMD EPYC (family
# 25 model 1, AVX2, no AVX-512) 6.1x bf16 (62.9 s against 10.3 s for 20 steps, issue #29).
MEASURED_SLOWDOWN = {"bf16": "6x (AMD EPYC, AVX2) to 18x (Xeon capped at AVX2)",
                     "fp16": "24x (Xeon capped at AVX2)"}


@dataclass(frozen=True)
class LowpSupport:
    """Whether ``precision`` runs natively on ``device``; ``reason`` says why not."""

    precision: str
    device: str
    native: bool
    reason: str = ""

    def warning(self) -> str | None:
        """One line for users when autocast would be emulated here, else ``None``."""
        if self.native or self.precision == "fp32":
            return None
        slow = MEASURED_SLOWDOWN.get(self.precision) if self.device == "cpu" else None
        cost = f"; hvdkit measured it {slow} slower than fp32 (benchmarks/cpu_precision.py)" if slow else ""
        return (f"--precision {self.precision} is emulated on this {self.device.upper()}: {self.reason}{cost}. "
                f"HINT: use --precision fp32 here; keep {self.precision} for machines that have it "
                "(hvdkit doctor shows which)")


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags Linux reports (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _onednn_has(precision: str) -> bool:
    """oneDNN's own answer; it honours ONEDNN_MAX_CPU_ISA (a cap set by the user or a test)."""
    probe = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[precision]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a torch without the probe: judge by the flags alone
        flags = cpu_flags()
        return any(all(f in flags for f in group) for group in _CPU_NEEDS[precision])


def lowp_support(precision: str, device: torch.device | str = "cpu") -> LowpSupport:
    """Whether autocast to ``precision`` has native kernels on ``device`` (fp32 always does)."""
    kind = torch.device(device).type
    if precision == "fp32":
        return LowpSupport(precision, kind, True)
    if kind == "cuda":
        if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name()
            return LowpSupport(precision, kind, False, f"{name} has no native bf16 (needs compute capability 8.0+)")
        return LowpSupport(precision, kind, True)
    if kind != "cpu":
        return LowpSupport(precision, kind, True)
    if _onednn_has(precision):
        return LowpSupport(precision, kind, True)
    flags = cpu_flags()
    groups = _CPU_NEEDS[precision]
    if any(all(f in flags for f in group) for group in groups):  # the CPU has it: a cap hides it
        why = f"oneDNN is capped below them (ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')})"
    else:
        why = f"this CPU lacks {', '.join(sorted({f for g in groups for f in g} - flags))}"
    return LowpSupport(precision, kind, False,
                       f"oneDNN's {precision} kernels need {_CPU_NEEDS_TEXT[precision]} and {why}")


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast to ``precision`` on ``device`` (CPU and CUDA); nothing for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=_DTYPES[precision]):
        yield


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16 (its state goes into checkpoints); ``None`` otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
