"""Helpers the tests share (not tests themselves): fake backends, model writers, a hub stand-in, a policy simulator,
statistics. Tests import them as `support.NAME`."""
