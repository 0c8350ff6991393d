"""Test setup: a simulated 8-device CPU mesh, set before any JAX backend starts."""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Bytecode is written while the tests are collected, even under PYTHONDONTWRITEBYTECODE=1 (this image
# and CI set it; __pycache__ is git-ignored): without it every pytest process (each xdist worker)
# rewrote and compiled every test module's asserts again when it collected (~9 of its ~14 CPU s), and
# every CLI process a test starts compiled stagetool from source (stagetool is compiled whole once,
# below; the CLI processes keep the variable and read it). Once collected, the environment's setting is
# back: a module a test writes and then edits (a model in tmp_path, edited to the same size within the
# same second) must not be imported from a stale __pycache__ entry, which is keyed by the source's
# whole-second mtime and size (test_keras' LayoutMap edit read "no changes" so).
_DONT_WRITE_BYTECODE = sys.dont_write_bytecode
sys.dont_write_bytecode = False

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# CLI and import-isolation fixtures shared by the foundation tests (defined in tests/helpers.py).
from helpers import isolated_imports, mlp_copy, run_cli, run_cli_shared, shared_facts_cache  # noqa: E402, F401

# No test writes to the user's cache folder: the facts cache is off unless a test turns it on
# (with --cache-dir or Options.cache_dir), and any default would be a session temporary folder.
import tempfile  # noqa: E402

os.environ["STAGETOOL_NO_CACHE"] = "1"
os.environ.setdefault("STAGETOOL_CACHE_DIR", tempfile.mkdtemp(prefix="stagetool-test-cache-"))


# ---- tests that hold on some JAX releases only -----------------------------------------------------

import operator  # noqa: E402

import pytest  # noqa: E402

_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
            "!=": operator.ne}


def jax_matches(spec: str, version: str | None = None) -> bool:
    """Whether the installed jax (or ``version``) satisfies ``spec``: comparisons joined by commas
    (and) and ``|`` (or), ``'>=0.10'``, ``'>=0.8,<0.11'``, ``'<0.10|>=0.12'``, compared as numeric
    tuples (``0.12.0.1`` >= ``0.12``)."""
    if "|" in spec:
        return any(jax_matches(alternative, version) for alternative in spec.split("|"))
    from stagetool.core.compat import version_tuple

    have = version_tuple(version if version is not None else jax.__version__)
    for clause in spec.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*", clause)
        if not m:
            raise ValueError(f"jax_version marker: {clause!r} is not a comparison like '>=0.10'")
        want = version_tuple(m.group(2))
        if not _COMPARE[m.group(1)](have[:len(want)], want):
            return False
    return True


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.jax_version('>=0.10', reason=...)``: skipped, saying why, on other releases."""
    for item in items:
        for mark in item.iter_markers("jax_version"):
            spec = mark.args[0]
            if not jax_matches(spec):
                why = mark.kwargs.get("reason", "")
                item.add_marker(pytest.mark.skip(reason=f"jax {jax.__version__}: needs jax {spec}" +
                                                 (f" ({why})" if why else "")))
    durations.fast_lane(config, items)


# nor to the user's config folder: the cache's secret (staging/cache.py) is a session temporary file
os.environ.setdefault("STAGETOOL_CACHE_KEY_FILE", os.path.join(tempfile.mkdtemp(prefix="stagetool-test-key-"),
                                                               "facts-cache.key"))


# ---- the durations table and the fast lane (tests/durations.py) -----------------------------------

import durations  # noqa: E402
from durations import pytest_runtest_makereport  # noqa: E402, F401


def pytest_addoption(parser):
    durations.addoption(parser)


def pytest_collection_finish(session):
    """Bytecode writing back to the environment's setting once the test modules are collected (above)."""
    import compileall
    from pathlib import Path

    compileall.compile_dir(Path(__file__).resolve().parents[1] / "stagetool", quiet=1)
    sys.dont_write_bytecode = _DONT_WRITE_BYTECODE


def pytest_configure(config):
    durations.configure(config)


def pytest_report_header(config):
    return durations.report_header(config)


def pytest_terminal_summary(terminalreporter, config):
    durations.terminal_summary(terminalreporter, config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    durations.phase_starts(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    durations.phase_starts(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    durations.phase_starts(item)
