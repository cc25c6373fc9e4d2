"""Where the tests find the repository: the one place that knows how deep a file sits. Test files live one folder
below `tests/` (tests/engine/, tests/server/, ...), helpers in tests/support/; every path to a file of the checkout
starts from REPO, so a test runs this checkout's llamaspec, scripts and examples, never an installed copy's."""
from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
