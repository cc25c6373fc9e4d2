"""Synthetic models whose draft agreement is known: for timing speculation on real shapes."""
