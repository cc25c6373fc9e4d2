"""Draft-length policies: the contract (base.py), the fixed / confidence / threshold policies (simple.py) and `auto`
(auto.py: its cost model in costs.py, its tuning in tuning.py), the load-time calibration (calibration.py)."""
from __future__ import annotations

from .. import bounds
from ..config import POLICY_NAMES, DraftSettings
from ..errors import InvalidParameterError
from .auto import AutoPolicy, Phase
from .base import Costs, DraftPolicy, Hooks, check_k, check_p
from .simple import ConfidencePolicy, FixedPolicy, ThresholdPolicy
from .tuning import AutoTuning


def make_policy(name: str = "auto", *, k: int | None = None, k_min: int | None = None,
                p_min: float | None = None, n_batch: int | None = None) -> DraftPolicy:
    """Build a policy from CLI/server style settings: k is the draft length (fixed) or its maximum (others),
    within what one batch of `n_batch` tokens verifies (the ranges: bounds.py)."""
    known = {"n_batch": n_batch} if n_batch else {}
    for param, value in (("draft_max", k), ("draft_min", k_min), ("draft_p_min", p_min)):
        if value is not None:
            bounds.check(param, value, known)
    if name == "fixed":
        return FixedPolicy(4 if k is None else k, 0.0 if p_min is None else p_min)
    if name == "confidence":
        return ConfidencePolicy(8 if k is None else k, 0.75 if p_min is None else p_min)
    if name == "threshold":
        k_max = 8 if k is None else k
        return ThresholdPolicy(k=min(4, k_max), k_min=1 if k_min is None else k_min, k_max=k_max,
                               p_min=0.0 if p_min is None else p_min)
    if name == "auto":
        return AutoPolicy(k_max=12 if k is None else max(k, 1), p_min=0.0 if p_min is None else p_min)
    raise InvalidParameterError(f"unknown draft policy {name!r}; choose one of {', '.join(POLICY_NAMES)}",
                                param="policy")


def policy_for(drafting: DraftSettings, n_batch: int | None = None) -> DraftPolicy:
    """The policy a DraftSettings names, with its settings (within what a batch of `n_batch` verifies)."""
    return make_policy(drafting.policy, k=drafting.k, k_min=drafting.k_min, p_min=drafting.p_min, n_batch=n_batch)


__all__ = ["AutoPolicy", "AutoTuning", "ConfidencePolicy", "Costs", "DraftPolicy", "FixedPolicy", "Hooks", "Phase",
           "POLICY_NAMES", "ThresholdPolicy", "check_k", "check_p", "make_policy", "policy_for"]
