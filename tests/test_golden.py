"""The examples' reports and snapshots equal the golden files (tests/golden/regenerate.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))

import regenerate  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(regenerate.CASES))
def test_golden(name):
    expected = (regenerate.GOLDEN / name).read_text(encoding="utf-8")
    actual = regenerate.produce(name)
    assert actual == expected, (f"{name} differs from the golden file; if the change is intended, run "
                                "'python tests/golden/regenerate.py' and review the diff")
