"""Tests of stagetool.analysis.memory: memory_analysis(), donation aliasing, sizes, capacity."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.staging.gather import memory_result
from stagetool.analysis import memory
from stagetool.devices import provision as devices
from stagetool.core import units
from stagetool.core.errors import UsageError
from stagetool.core.units import format_bytes

F32 = 4


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_argument_and_output_bytes_are_per_device_shards():
    M, K, N = 256, 128, 512
    mesh = _mesh()
    a = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    b = jax.ShapeDtypeStruct((K, N), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    compiled = jax.jit(lambda a, b: a @ b).trace(a, b).lower().compile()
    rec = memory.memory_of(memory_result(compiled))
    assert rec.reason is None
    assert rec.argument_bytes == (M // 2 * K + K * N // 4) * F32
    assert rec.output_bytes == M // 2 * N // 4 * F32
    raw = compiled.memory_analysis()
    for field, attr in memory._FIELDS:
        assert getattr(rec, field) == getattr(raw, attr), field
    assert rec.peak_bytes_reported == raw.peak_memory_in_bytes


def test_peak_includes_temp_even_when_reported_peak_does_not():
    n = 1024

    def f(x, y):
        # sorted, so that every release keeps the outer product in memory (XLA:CPU of jaxlib 0.12
        # fuses sin(outer) into a sum: temporaries 0)
        return jnp.sort(jnp.sin(x[:, None] * y[None, :]), axis=1)[:, 0]

    x = jax.ShapeDtypeStruct((n,), jnp.float32)
    rec = memory.memory_of(memory_result(jax.jit(f).trace(x, x).lower().compile()))
    assert rec.argument_bytes == 2 * n * F32 and rec.output_bytes == n * F32
    assert rec.temp_bytes >= n * n * F32  # the outer product lives in the temp allocation
    assert rec.peak_bytes_estimate == rec.argument_bytes + rec.output_bytes - rec.alias_bytes + rec.temp_bytes
    assert rec.peak_bytes >= n * n * F32
    if jax.default_backend() == "cpu":  # jaxlib 0.10.2 CPU: peak_memory_in_bytes leaves out temp
        assert rec.peak_bytes_reported < rec.temp_bytes
        assert rec.peak_source == memory.SUM_SOURCE and rec.peak_bytes == rec.peak_bytes_estimate
        assert rec.suspects == ()  # the sum is the larger: XLA's figure does not feed the peak


def test_the_peak_is_the_larger_of_the_sum_and_xlas_peak():
    """One definition: the larger of arguments + outputs - aliased + temporaries and XLA's
    peak_memory_in_bytes (XLA:TPU reports temp 0 and the temporaries only in its peak)."""
    stats = {"argument_size_in_bytes": 100_000, "output_size_in_bytes": 100_000, "alias_size_in_bytes": 0,
             "temp_size_in_bytes": 50_000, "generated_code_size_in_bytes": 0}
    for reported, peak, source in ((180_000, 250_000, memory.SUM_SOURCE), (400_000, 400_000, memory.XLA_PEAK_SOURCE),
                                   (250_000, 250_000, memory.SUM_SOURCE), (0, 250_000, memory.SUM_SOURCE),
                                   (None, 250_000, memory.SUM_SOURCE)):
        rec = memory.normalise_memory({**stats, "peak_memory_in_bytes": reported})
        assert (rec.peak_bytes_reported, rec.peak_bytes_estimate, rec.peak_bytes, rec.peak_source) == (
            reported, 250_000, peak, source)
        assert rec.peak_bytes >= rec.peak_bytes_estimate and rec.peak_bytes >= (reported or 0)
        assert rec.suspects == ()
    only_xla = memory.normalise_memory({"peak_memory_in_bytes": 7})
    assert (only_xla.peak_bytes, only_xla.peak_source, only_xla.reason) == (7, memory.XLA_PEAK_SOURCE, None)


def test_a_suspect_part_of_the_peak_gives_no_verdict():
    """A peak built on a suspect figure cannot fit or not fit: the verdict is unknown, with the reason."""
    rec = memory.normalise_memory({"argument_size_in_bytes": 10, "output_size_in_bytes": 6, "alias_size_in_bytes": 8,
                                   "temp_size_in_bytes": 0, "peak_memory_in_bytes": 5})
    assert [s.field for s in rec.peak_suspects] == ["alias_bytes"]
    v = memory.fit_verdict(rec.peak_bytes, 1000, suspects=rec.peak_suspects)
    assert v.fits is None and "suspect" in v.reason and "aliased bytes 8 exceed output bytes 6" in v.reason
    assert memory.fit_verdict(rec.peak_bytes, 1000).fits is True
    # a suspect XLA peak only matters when it is the figure that gives the peak
    low = memory.normalise_memory({"argument_size_in_bytes": 10, "output_size_in_bytes": 0, "alias_size_in_bytes": 0,
                                   "temp_size_in_bytes": 0, "peak_memory_in_bytes": -1})
    assert [s.field for s in low.suspects] == ["peak_bytes_reported"] and low.peak_suspects == ()
    assert low.peak_source == memory.SUM_SOURCE


def test_host_memory_is_apart_from_the_device_peak():
    """pinned_host (S(5)) bytes never enter the device peak; host_peak_bytes is their own sum."""
    rec = memory.normalise_memory({"argument_size_in_bytes": 100, "output_size_in_bytes": 50, "alias_size_in_bytes": 0,
                                   "temp_size_in_bytes": 10, "host_argument_size_in_bytes": 0,
                                   "host_output_size_in_bytes": 0, "host_alias_size_in_bytes": 0,
                                   "host_temp_size_in_bytes": 4096, "peak_memory_in_bytes": 0})
    assert (rec.peak_bytes, rec.host_peak_bytes) == (160, 4096)


def test_no_memory_analysis_is_data():
    rec = memory.normalise_memory(None)
    assert rec.reason and rec.peak_bytes is None and rec.argument_bytes is None
    broken = types.SimpleNamespace(memory_analysis=lambda: (_ for _ in ()).throw(RuntimeError("x")))
    assert "RuntimeError" in memory.memory_of(memory_result(broken)).reason
    assert memory.normalise_memory(object()).reason


def test_donation_does_not_change_the_peak_sgd_step():
    """The issue's SGD step: XLA's peak_memory_in_bytes on CPU reads 12.0 MiB without donation and
    8.0 MiB with it (it leaves out the temp block, which grows by the donated output); the gated
    peak is 20.0 MiB both ways: arguments 8 MiB + outputs 4 MiB (+20 B of the scalar) - aliased + temps."""
    import jax
    import jax.numpy as jnp

    def step(params, grads):
        new = jax.tree.map(lambda p, g: p - 0.1 * jnp.tanh(g) @ jnp.tanh(g).T @ p, params, grads)
        return new, jnp.sum(new["w"])

    x = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    mib = 1024 * 1024
    recs = [memory.normalise_memory(jax.jit(step, donate_argnums=d).trace(x, x).lower().compile().memory_analysis())
            for d in ((), (0,))]
    assert recs[1].alias_bytes == 4 * mib and recs[0].alias_bytes == 0
    assert recs[0].peak_bytes == recs[1].peak_bytes
    assert recs[0].peak_bytes >= 2 * 4 * mib + 4 * mib + 4  # both arguments, the new w and the scalar
    assert recs[0].peak_bytes == recs[0].argument_bytes + recs[0].output_bytes + recs[0].temp_bytes


# --------------------------------------------------------------------------- donation


def test_donated_jit_aliases_parameter_to_output():
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    compiled = jax.jit(lambda x, y: (x + 1, y * 2), donate_argnums=(0,)).trace(x, x).lower().compile()
    aliases = memory.parse_input_output_alias(compiled.as_text())
    assert aliases == (memory.AliasEntry((0,), 0, (), "may-alias"),)
    status = memory.donation_status([True, False], aliases)
    assert [(s.parameter_number, s.status, s.aliased_output_indices) for s in status] == [
        (0, "aliased", ((0,),)), (1, "not requested", ())]
    # argument 0's buffer is reused for output 0: the alias size is its bytes
    assert memory.memory_of(memory_result(compiled)).alias_bytes == 64 * 64 * F32


def test_donation_not_usable_is_reported():
    a = jax.ShapeDtypeStruct((16,), jnp.float32)
    c = jax.ShapeDtypeStruct((64,), jnp.float32)
    with pytest.warns(UserWarning, match="Some donated buffers were not usable"):
        compiled = jax.jit(lambda a, c: (a.sum(), c + 1), donate_argnums=(0, 1)).trace(a, c).lower().compile()
    aliases = memory.parse_input_output_alias(compiled.as_text())
    status = memory.donation_status([True, True], aliases)
    assert [(s.status, s.aliased_output_indices) for s in status] == [("not usable", ()), ("aliased", ((1,),))]


def test_parse_alias_header_forms():
    text = ("HloModule m, is_scheduled=true, input_output_alias={ {1, 0}: (2, {1}, must-alias), "
            "{0}: (0, {}, may-alias), {}: (3, {}) }, entry_computation_layout={(f32[2]{0})->f32[2]{0}}\n"
            "ENTRY %main {}\n")
    assert memory.parse_input_output_alias(text) == (
        memory.AliasEntry((), 3, (), "may-alias"),
        memory.AliasEntry((0,), 0, (), "may-alias"),
        memory.AliasEntry((1, 0), 2, (1,), "must-alias"),
    )
    assert memory.parse_input_output_alias("HloModule m, entry_computation_layout={()->()}") == ()
    assert memory.parse_input_output_alias("") == ()
    odd = memory.donation_status([False], [memory.AliasEntry((0,), 0, (), "may-alias")])
    assert odd[0].status == "aliased without request"


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text,expected", [
    ("16GiB", 16 * 2**30), ("512MB", 512 * 10**6), ("1.5GB", 1_500_000_000), ("1.5 GiB", 3 * 2**29),
    ("100", 100), ("7B", 7), ("2kib", 2048), ("0.1KiB", 102), (".5KB", 500), (4096, 4096), ("1TB", 10**12),
])
def test_parse_size(text, expected):
    assert units.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "16 GiBs", "-1GB", "1e9", "16Gb/s", -5, True, "1,5GB"])
def test_parse_size_errors(bad):
    with pytest.raises(UsageError):
        units.parse_size(bad)


@pytest.mark.parametrize("n,expected", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (16 * 2**30, "16.0 GiB"),
    (3 * 2**30, "3.00 GiB"), (-2048, "-2.00 KiB"), (None, "n/a"), (900 * 2**20, "900 MiB"),
])
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


def test_format_parse_round_trip():
    for n in (2**20, 3 * 2**30, 5 * 2**40):
        assert units.parse_size(format_bytes(n).replace(" ", "")) == n


# --------------------------------------------------------------------------- capacity and verdict


def test_cpu_device_capacity_is_none_with_reason():
    cap = devices.device_capacity(jax.devices()[0])
    assert jax.devices()[0].memory_stats() is None
    assert cap.bytes_limit is None and "memory_stats" in cap.reason


def test_device_capacity_from_memory_stats():
    dev = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 123, "bytes_in_use": 1})
    assert devices.device_capacity(dev) == devices.Capacity(123, "jax.Device.memory_stats()['bytes_limit']")
    assert devices.device_capacity(types.SimpleNamespace(memory_stats=lambda: {"x": 1})).bytes_limit is None


def test_fit_verdict():
    v = memory.fit_verdict(3 * 2**30, units.parse_size("16GiB"))
    assert v.fits is True and v.share_used == pytest.approx(3 / 16) and v.headroom_bytes == 13 * 2**30
    over = memory.fit_verdict(17 * 2**30, 16 * 2**30)
    assert over.fits is False and over.headroom_bytes == -(2**30)
    assert memory.fit_verdict(None, 10).fits is None and memory.fit_verdict(None, 10).reason
    assert memory.fit_verdict(10, None).reason
    assert memory.fit_verdict(10, 10).fits is True
