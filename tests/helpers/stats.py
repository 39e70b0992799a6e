"""Statistical tests for sampled outputs."""

from __future__ import annotations

import torch


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> tuple[bool, float, float]:
    """Pearson's test of counts [V] against probs [V] (bins expected below 5 merged into one; a count where
    p is 0 fails outright): (not rejected at alpha, the statistic, the critical value). scipy's chi2
    quantile when scipy imports, else Wilson-Hilferty's approximation of it."""
    counts, probs = counts.detach().double(), probs.detach().double()
    if counts[probs == 0].sum() > 0:
        return False, float("inf"), 0.0
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    try:
        from scipy.stats import chi2

        crit = float(chi2.ppf(1 - alpha, df))
    except ImportError:  # Wilson-Hilferty with z(0.999) = 3.0902
        crit = df * (1 - 2 / (9 * df) + 3.0902 * (2 / (9 * df)) ** 0.5) ** 3
    return stat <= crit, stat, crit
