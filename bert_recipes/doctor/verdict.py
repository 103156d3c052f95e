"""A verdict of the node doctor: one Check, and how readings NVML refuses are recorded."""
from __future__ import annotations

from dataclasses import asdict, dataclass

STATUSES = ("ok", "warn", "fail")


@dataclass
class Check:
    """One verdict: `measured` against `expected`, and what to do when it is not ok."""
    name: str
    status: str        # ok | warn | fail
    measured: str
    expected: str = ""
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4} {self.name}: {self.measured}"
        if self.expected:
            text += f" (expected {self.expected})"
        if self.fix and self.status != "ok":
            text += f"; fix: {self.fix}"
        return text

    def as_dict(self) -> dict:
        return asdict(self)


NOT_SUPPORTED = "not supported"   # how a reading NVML refuses (NVML_ERROR_NOT_SUPPORTED) is recorded


def supported(*values) -> bool:
    """Every value a number: not missing, not "not supported", not "unreadable: ..." (nvml._read)."""
    return all(v is not None and not isinstance(v, str) for v in values)


def gib(n: float) -> str:
    return f"{n / 1024 ** 3:.1f} GiB"
