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


# the longest draft each policy proposes when draft_max is left open
DEFAULT_DRAFT_MAX = {"fixed": 4, "confidence": 8, "threshold": 8, "auto": 12}


def make_policy(name: str = "auto", *, draft_max: int | None = None, draft_min: int | None = None,
                draft_p_min: float | None = None, n_batch: int | None = None) -> DraftPolicy:
    """Build a policy from CLI/server style settings: draft_max is the draft length (fixed) or its maximum (the
    others), within what one batch of `n_batch` tokens verifies (the ranges: bounds.py). None: the policy's
    default."""
    known = {"n_batch": n_batch} if n_batch else {}
    for param, value in (("draft_max", draft_max), ("draft_min", draft_min), ("draft_p_min", draft_p_min)):
        if value is not None:
            bounds.check(param, value, known)
    if name not in DEFAULT_DRAFT_MAX:
        raise InvalidParameterError(f"unknown draft policy {name!r}; choose one of {', '.join(POLICY_NAMES)}",
                                    param="policy")
    if draft_max is None:
        draft_max = DEFAULT_DRAFT_MAX[name]
    if name == "fixed":
        return FixedPolicy(draft_max, 0.0 if draft_p_min is None else draft_p_min)
    if name == "confidence":
        return ConfidencePolicy(draft_max, 0.75 if draft_p_min is None else draft_p_min)
    if name == "threshold":
        return ThresholdPolicy(draft_len=min(4, draft_max), draft_min=1 if draft_min is None else draft_min,
                               draft_max=draft_max, draft_p_min=0.0 if draft_p_min is None else draft_p_min)
    return AutoPolicy(draft_max=max(draft_max, 1), draft_p_min=0.0 if draft_p_min is None else draft_p_min)


def policy_for(drafting: DraftSettings, n_batch: int | None = None) -> DraftPolicy:
    """The policy a DraftSettings names, with its settings (within what a batch of `n_batch` verifies)."""
    return make_policy(drafting.policy, draft_max=drafting.draft_max, draft_min=drafting.draft_min,
                       draft_p_min=drafting.draft_p_min, n_batch=n_batch)


__all__ = ["AutoPolicy", "AutoTuning", "ConfidencePolicy", "Costs", "DEFAULT_DRAFT_MAX", "DraftPolicy", "FixedPolicy", "Hooks", "Phase",
           "POLICY_NAMES", "ThresholdPolicy", "check_k", "check_p", "make_policy", "policy_for"]
