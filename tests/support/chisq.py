"""Pearson's chi-square goodness-of-fit test, for the tests that check sampled tokens follow a distribution."""
import numpy as np

# critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
                  10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25}


def critical_value(dof: int) -> float:
    """The 0.1% critical value: the table, or past it Wilson and Hilferty's cube-root approximation."""
    if dof in CHI2_CRIT_0001:
        return CHI2_CRIT_0001[dof]
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + 3.0902 * h ** 0.5) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over bins with expected count >= 5 (the rest pooled into one bin)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    obs, exp = np.array(obs), np.array(exp)
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    """The counts are a sample of probs: nothing outside its support, and chi-square below the 0.1% level."""
    assert counts[probs == 0].sum() == 0, "a token outside the distribution's support was drawn"
    stat, dof = chi_square(counts, probs)
    assert dof >= 1
    assert stat < critical_value(dof), f"chi2={stat:.1f} with {dof} dof"
