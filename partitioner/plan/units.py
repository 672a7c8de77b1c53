"""How plans write quantities: bytes, seconds, FLOPs and counts, in the unit that reads best."""

from __future__ import annotations

import math

__all__ = ["fmt_bytes", "fmt_time", "fmt_flops", "fmt_count"]


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``; infinity reads as 'unlimited'."""
    if math.isinf(n):
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable: the loop returns at TiB


def fmt_time(seconds: float) -> str:
    """``0.0123 -> '12.3 ms'``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_flops(n: float) -> str:
    """``2.5e12 -> '2.50 T'``."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def fmt_count(n: float) -> str:
    """``124_000_000 -> '124.0M'``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"
