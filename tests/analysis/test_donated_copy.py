"""Issue 48: a donated input that XLA copies anyway (a carry read after its in-place write) is named
a copy of that input, at the line that reads it, with why; not an anonymous ``copy.1{}`` row."""

from __future__ import annotations

import pytest
from helpers import write

CODE = """\
import jax.numpy as jnp


def read_after(cache, x):
    new = cache.at[0].set(x)
    return new, cache[0] * 2


def read_before(cache, x):
    old = cache[0] * 2
    return cache.at[0].set(x), old
"""

SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  read_after:
    target: m.py:read_after
    args: ['f32[64,1024,256] @ [null, data]', 'f32[1024,256] @ [data]']
    donate: [0]
  read_before:
    target: m.py:read_before
    args: ['f32[64,1024,256] @ [null, data]', 'f32[1024,256] @ [data]']
    donate: [0]
"""


@pytest.fixture
def doc(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "m.py", CODE)
    write(tmp_path, "m.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    return run_cli("memory", "--no-cache", "--format", "json", check=0).json()


def _raw_copies_of_parameter_0(tmp_path, name):
    """Raw JAX's compile of the same step: the metadata-less copies of the donated parameter 0."""
    import importlib.util

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    spec = importlib.util.spec_from_file_location(f"donated_copy_{name}", tmp_path / "m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    shardings = (NamedSharding(mesh, P(None, "data")), NamedSharding(mesh, P("data")))
    args = (jax.ShapeDtypeStruct((64, 1024, 256), np.float32, sharding=shardings[0]),
            jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=shardings[1]))
    compiled = jax.jit(getattr(module, name), in_shardings=shardings, donate_argnums=0).lower(*args).compile()
    entry = compiled.as_text().split("\nENTRY ", 1)[1].splitlines()
    param = next(line.split("=")[0].strip().lstrip("%") for line in entry if " parameter(0)" in line)
    return [line for line in entry if f"copy(%{param})" in line and "metadata" not in line], compiled


@pytest.mark.parametrize("name, read, written", [("read_after", 6, 5), ("read_before", 10, 11)])
def test_a_donated_input_xla_copies_is_named_a_copy_of_it_with_its_line_and_why(doc, tmp_path, name, read, written):
    memory = {f["name"]: f for f in doc["functions"]}[name]["memory"]
    raw_copies, compiled = _raw_copies_of_parameter_0(tmp_path, name)
    # XLA:CPU copies the donated cache in both orders (its copy insertion keeps the old value for the read)
    assert len(raw_copies) == 1, "XLA:CPU makes no copy of the donated input here: the test needs another program"
    assert memory["record"]["temp_bytes"] == compiled.memory_analysis().temp_size_in_bytes
    rows = [b for b in memory["peak"]["buffers"] if b["op_name"] == "copy of cache (donated)"]
    assert len(rows) == 1 and rows[0]["size_bytes"] == 64 * 128 * 256 * 4
    assert rows[0]["instruction_name"] == raw_copies[0].split("=")[0].strip().lstrip("%")
    assert (rows[0]["file"].rsplit("/", 1)[-1], rows[0]["line"]) == ("m.py", read)  # where the old value is read
    assert (f"is a copy of the donated input cache (parameter 0) that XLA makes anyway: its old value is read at "
            f"m.py:{read} (mul) while its buffer is written in place at m.py:{written} (scatter)") in memory["peak"]["note"]


def test_a_copy_of_an_input_that_is_not_donated_is_not_called_one(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "m.py", CODE)
    write(tmp_path, "m.stagetool.yaml", SPEC.replace("    donate: [0]\n", ""))
    monkeypatch.chdir(tmp_path)
    fn = run_cli("memory", "-f", "read_after", "--no-cache", "--format", "json", check=0).json()["functions"][0]
    assert not any((b["op_name"] or "").startswith("copy of") for b in fn["memory"]["peak"]["buffers"])
    assert "copy of the donated input" not in (fn["memory"]["peak"]["note"] or "")
