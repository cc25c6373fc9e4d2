"""Probes: one measurement each (a cost curve, a profile, an overhead, a bound)."""
