"""The examples' reports and snapshots equal the golden files of the JAX installed here
(tests/golden/jax-<version>/, written by tests/golden/regenerate.py)."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tests" / "golden"))

import regenerate  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(not regenerate.golden_dir().is_dir(),
                    reason=f"no golden files for {regenerate.release()} (XLA's figures differ between releases; "
                           "tests/golden/regenerate.py writes this release's set)")
@pytest.mark.parametrize("name", sorted(regenerate.CASES))
def test_golden(name):
    expected = (regenerate.golden_dir() / name).read_text(encoding="utf-8")
    actual = regenerate.produce(name)
    assert actual == expected, (f"{name} differs from tests/golden/{regenerate.release()}/{name}; if the change "
                                "is intended, run 'python tests/golden/regenerate.py --all' and review the diff")
