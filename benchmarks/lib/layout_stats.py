"""The layout benchmark's statistics on plain data (``benchmarks/layout.py``): ranks, Spearman's
rank correlation, the median relative error, and the issue's three targets.

Written here rather than taken from scipy.stats: scipy is not a dependency of the project.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["CHOICE_WITHIN", "MEDIAN_ERROR_AT_MOST", "SPEARMAN_AT_LEAST", "ranks", "spearman", "median_abs_error",
           "targets", "errors"]

# The targets: choice within 10% of the best; median |pred / meas - 1| <= 0.15; Spearman >= 0.8.
CHOICE_WITHIN, MEDIAN_ERROR_AT_MOST, SPEARMAN_AT_LEAST = 0.10, 0.15, 0.8




def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, smallest first; tied values share the mean of the ranks they span.

    Example:
        >>> ranks([0.3, 0.1, 0.2, 0.1])
        [4.0, 1.5, 3.0, 1.5]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's over the tie-averaged ranks; NaN when either side is constant.

    Raises:
        ValueError: ``x`` and ``y`` differ in length or hold fewer than two values.

    Example:
        >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
        (1.0, -1.0)
    """
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two sequences of equal length >= 2, got {len(x)} and {len(y)} values")
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx and vy else math.nan


def median_abs_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The median of ``|predicted / measured - 1|``.

    Example:
        >>> median_abs_error([1.1, 0.5, 2.0], [1.0, 1.0, 1.0])
        0.5
    """
    return statistics.median(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))


def targets(predicted: dict[str, float], measured: dict[str, float], choice: str) -> dict[str, Any]:
    """The issue's three figures and whether each meets its target.

    Args:
        predicted, measured: seconds per step, by layout name (the same names).
        choice: the planner's layout.

    Example:
        >>> t = targets({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.2, "b": 1.0, "c": 3.0}, "a")
        >>> t["choice_measured_rank"], round(t["choice_vs_best"], 3), t["choice_within_10pct"], t["spearman"]
        (2, 0.2, False, 0.5)
    """
    if predicted.keys() != measured.keys() or choice not in measured:
        raise ValueError(f"predicted and measured must name the same layouts, and the choice {choice!r} one of them")
    names = list(measured)
    pred, meas = [predicted[n] for n in names], [measured[n] for n in names]
    best = min(meas)
    by_measured = sorted(names, key=lambda n: measured[n])
    vs_best = measured[choice] / best - 1
    error = median_abs_error(pred, meas)
    rho = spearman(pred, meas)
    return {
        "choice": choice, "measured_best": by_measured[0], "choice_measured_rank": by_measured.index(choice) + 1,
        "layouts": len(names), "choice_vs_best": vs_best, "choice_within_10pct": vs_best <= CHOICE_WITHIN,
        "median_abs_error": error, "median_abs_error_ok": error <= MEDIAN_ERROR_AT_MOST,
        "spearman": None if math.isnan(rho) else rho, "spearman_ok": rho >= SPEARMAN_AT_LEAST,
    }


def errors(predicted: dict[str, float], measured: dict[str, float], names: Iterable[str]) -> dict[str, Any]:
    """The prediction's errors over the layouts ``names`` alone (a part of the space: its tp > 1 rows, say):
    how many, the median ``|predicted / measured - 1|``, the median ``predicted / measured`` (its
    sign: too fast or too slow), Spearman's rank correlation within them (``None`` under two layouts
    or a constant side), and the measured and predicted best among them.

    Raises:
        ValueError: a name is missing from ``predicted`` or ``measured`` (the names given).

    Example:
        >>> e = errors({"a": 1.0, "b": 2.0, "c": 9.0}, {"a": 1.25, "b": 2.5, "c": 1.0}, ["a", "b"])
        >>> e["layouts"], round(e["median_abs_error"], 3), round(e["median_pred_over_meas"], 3), e["spearman"]
        (2, 0.2, 0.8, 1.0)
    """
    chosen = list(names)
    missing = [n for n in chosen if n not in predicted or n not in measured]
    if missing:
        raise ValueError(f"layouts {missing} are not among those predicted and measured ({sorted(measured)})")
    if not chosen:
        return {"layouts": 0}
    pred, meas = [predicted[n] for n in chosen], [measured[n] for n in chosen]
    rho = spearman(pred, meas) if len(chosen) >= 2 else math.nan
    return {
        "layouts": len(chosen), "median_abs_error": median_abs_error(pred, meas),
        "median_pred_over_meas": statistics.median(p / m for p, m in zip(pred, meas)),
        "spearman": None if math.isnan(rho) else rho,
        "measured_best": min(chosen, key=lambda n: measured[n]),
        "predicted_best": min(chosen, key=lambda n: predicted[n]),
    }
