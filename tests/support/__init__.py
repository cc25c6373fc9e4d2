"""Helpers the tests share (not tests themselves): fake backends, model writers, a hub stand-in, a policy simulator,
statistics, the repository's folders (paths.py), a server process, a terminal. Tests import them as `support.NAME`."""
