"""Tests of stagetool.core.chips: the table, user entries and the roofline estimate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from stagetool.staging.gather import cost_result
from stagetool.analysis import cost
from stagetool.analysis import roofline
from stagetool.core import chips
from stagetool.core.errors import SpecError, UsageError


def test_table_has_the_promised_chips_with_sources():
    assert set(chips.CHIPS) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "a100-40gb", "a100-80gb",
                                "h100-sxm", "h100-pcie", "h200", "b200"}
    for name, c in chips.CHIPS.items():
        assert c.name == name
        assert c.sources and all(s.startswith("https://") for s in c.sources)
        assert c.peak_flops_per_second_bf16 > 0 and c.hbm_bandwidth_bytes_per_second > 0
        assert c.hbm_capacity_bytes > 0
    assert chips.CHIPS["tpu-v5e"].peak_flops_per_second_f32 is None
    assert chips.CHIPS["h100-sxm"].peak_flops_per_second_bf16 == 989.5e12  # dense = half the sparse 1979


def test_get_chip():
    assert chips.get_chip(" TPU-v5e ") is chips.CHIPS["tpu-v5e"]
    with pytest.raises(UsageError) as e:
        chips.get_chip("tpu-v9")
    assert "tpu-v5e" in e.value.hint


@pytest.mark.parametrize("kind,name", [("TPU v5 lite", "tpu-v5e"), ("TPU v5", "tpu-v5p"), ("TPU v4", "tpu-v4"),
                                       ("TPU v6 lite", "tpu-v6e"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA H200", "h200"),
                                       ("cpu", None)])
def test_chip_for_device_kind(kind, name):
    assert chips.chip_for_device_kind(kind) == name


def test_merge_user_entries():
    table = chips.merge_chips({
        "my-npu": {"peak_flops_per_second_bf16": 1e14, "hbm_capacity_bytes": "24GiB",
                   "sources": "https://example.com/npu"},
        "TPU-v5e": {"hbm_capacity_bytes": 16 * 2**30},
    })
    assert table["my-npu"] == chips.Chip("my-npu", 1e14, None, None, 24 * 2**30, ("https://example.com/npu",))
    assert table["tpu-v5e"].hbm_capacity_bytes == 16 * 2**30
    assert table["tpu-v5e"].peak_flops_per_second_bf16 == 197e12  # untouched fields kept
    assert chips.CHIPS["tpu-v5e"].hbm_capacity_bytes == 16 * 2**30  # built-in table unchanged
    assert list(table) == sorted(table)


def test_numbers_written_as_yaml_1_1_strings_are_numbers():
    import yaml

    # PyYAML (YAML 1.1) reads 4.0e14 — the README's own example — as a string.
    entry = yaml.safe_load("peak_flops_per_second_bf16: 4.0e14\nhbm_bandwidth_bytes_per_second: 1e12\n"
                           "hbm_capacity_bytes: 3.2e10\npeak_flops_per_second_f32: '2_000'")
    assert entry["peak_flops_per_second_bf16"] == "4.0e14"
    c = chips.merge_chips({"npu": entry})["npu"]
    assert c.peak_flops_per_second_bf16 == 4.0e14 and c.hbm_bandwidth_bytes_per_second == 1e12
    assert c.hbm_capacity_bytes == 32_000_000_000 and isinstance(c.hbm_capacity_bytes, int)
    assert c.peak_flops_per_second_f32 == 2000.0
    with pytest.raises(SpecError, match="must be a positive finite number, got -1.0"):
        chips.merge_chips({"npu": {"peak_flops_per_second_bf16": "-1e0"}})


def test_merge_reports_every_problem():
    with pytest.raises(SpecError) as e:
        chips.merge_chips({
            "a": {"peak_flops_per_second_bf16": -1, "bogus": 1},
            "b": {"hbm_capacity_bytes": "lots"},
            "c": {"note": "no figures"},
            "d": 5,
            "h200": {"hbm_bandwidth_bytes_per_second": "fast", "sources": [1]},
        })
    issues = e.value.issues
    assert issues == [
        "chips.a.bogus: unknown field; valid fields: " + ", ".join(chips.CHIP_FIELDS),
        "chips.a.peak_flops_per_second_bf16: must be a positive finite number, got -1",
        "chips.a: a new chip needs at least one of " + ", ".join(chips._NEW_CHIP_NEEDS),
        "chips.b.hbm_capacity_bytes: invalid size 'lots': expected a number with an optional unit",
        "chips.b: a new chip needs at least one of " + ", ".join(chips._NEW_CHIP_NEEDS),
        "chips.c: a new chip needs at least one of " + ", ".join(chips._NEW_CHIP_NEEDS),
        "chips.d: expected a mapping of figures, got int",
        "chips.h200.hbm_bandwidth_bytes_per_second: expected a number, got 'fast'",
        "chips.h200.sources: expected a string or a list of strings",
    ]
    with pytest.raises(SpecError):
        chips.merge_chips([1, 2])


def test_roofline_arithmetic():
    chip = chips.Chip("toy", 100.0, 10.0, 20.0, 1, ("user",))
    r = roofline.roofline(chip, flops_per_device=1000.0, bytes_accessed_per_device=100.0)
    assert (r.compute_seconds, r.memory_seconds, r.lower_bound_seconds, r.bound) == (10.0, 5.0, 10.0, "compute")
    assert r.label == "estimate" and r.reason is None
    m = roofline.roofline(chip, flops_per_device=1000.0, bytes_accessed_per_device=100.0, dtype="f32")
    assert (m.compute_seconds, m.memory_seconds, m.bound) == (100.0, 5.0, "compute")
    mem = roofline.roofline(chip, flops_per_device=10.0, bytes_accessed_per_device=400.0)
    assert (mem.lower_bound_seconds, mem.bound) == (20.0, "memory")


def test_roofline_missing_inputs_give_none_with_reason():
    r = roofline.roofline(chips.CHIPS["tpu-v5e"], flops_per_device=1e12, bytes_accessed_per_device=None, dtype="f32")
    assert r.compute_seconds is None and r.memory_seconds is None and r.lower_bound_seconds is None
    assert r.bound is None
    assert r.reason == "no published f32 peak FLOP/s for tpu-v5e; bytes accessed not reported"
    neg = roofline.roofline(chips.CHIPS["h100-sxm"], flops_per_device=-1.0, bytes_accessed_per_device=1e9)
    assert neg.compute_seconds is None and neg.memory_seconds == pytest.approx(1e9 / 3.35e12)
    with pytest.raises(UsageError):
        roofline.roofline(chips.CHIPS["h200"], flops_per_device=1.0, bytes_accessed_per_device=1.0, dtype="fp8")


def test_roofline_from_a_real_per_device_cost():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    M = K = N = 512
    a = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    b = jax.ShapeDtypeStruct((K, N), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    rec = cost.per_device_cost(cost_result(jax.jit(lambda a, b: a @ b).trace(a, b).lower().compile()))
    h200 = chips.CHIPS["h200"]
    r = roofline.roofline(h200, flops_per_device=rec.flops, bytes_accessed_per_device=rec.bytes_accessed)
    assert r.compute_seconds == pytest.approx(2 * M * N * K / 8 / 989.5e12)
    assert r.memory_seconds == pytest.approx(rec.bytes_accessed / 4.8e12)
    assert r.lower_bound_seconds == max(r.compute_seconds, r.memory_seconds)


def test_hbm_capacities_agree_with_the_topology_table():
    """The roofline's chip table and the compile-only topology table give one capacity per chip."""
    from stagetool.devices.tpu_topology import TPU_CHIPS

    shared = [(chips.CHIPS[f"tpu-{t.alias}"], t) for t in TPU_CHIPS if f"tpu-{t.alias}" in chips.CHIPS]
    assert len(shared) == 4  # v4, v5e, v5p, v6e
    for chip, tpu in shared:
        assert chip.hbm_capacity_bytes == tpu.hbm_bytes_per_chip, tpu.alias
    assert chips.CHIPS["tpu-v5e"].hbm_capacity_bytes == 16 * 2**30


def test_the_peak_for_each_element_type_falls_back_to_bf16_where_none_is_published():
    """Chip.peak_for: fp8 types, 8- and 4-bit integers and f32/f64/complex read their own peak where the
    chip publishes one, else the bf16 peak (a TPU runs a default-precision f32 matmul as bf16 passes)."""
    import dataclasses

    own = dataclasses.replace(chips.get_chip("tpu-v5e"), peak_flops_per_second_bf16=1e14,
                              peak_flops_per_second_fp8=2e14, peak_flops_per_second_int8=4e14,
                              peak_flops_per_second_f32=5e13)
    assert [own.peak_for(t) for t in ("bf16", "f16", "f8e4m3fn", "f8e5m2", "s8", "u4", "f32", "f64", "c64")] == [
        1e14, 1e14, 2e14, 2e14, 4e14, 4e14, 5e13, 5e13, 5e13]
    bare = dataclasses.replace(own, peak_flops_per_second_fp8=None, peak_flops_per_second_int8=None,
                               peak_flops_per_second_f32=None)
    assert {bare.peak_for(t) for t in ("bf16", "f8e4m3fn", "s8", "u8", "f32", "c128")} == {1e14}


# ---- issue 47, item 6: figures that pass one by one but give no step time, or a false one ----------


def _spec_issues(chips_yaml: str) -> list[str]:
    from pathlib import Path

    from stagetool.spec.parse import parse_spec

    with pytest.raises(SpecError) as e:
        parse_spec("functions: {f: m.py:f}\nchips:\n" + chips_yaml, file="s.yaml", base_dir=Path("/base"))
    return e.value.issues


def test_a_huge_yaml_integer_is_refused_at_its_line_not_an_overflow():
    issues = _spec_issues("  tpu-v5e: {hbm_bandwidth_bytes_per_second: 1" + "0" * 400 + "}\n")
    assert issues == ["s.yaml:3:45: chips.tpu-v5e.hbm_bandwidth_bytes_per_second: an integer of 401 digits is outside "
                      "what one chip's figure can be (1 to 1e+21 per second): a step time from it would be no figure "
                      "or a false one"]
    with pytest.raises(SpecError, match="hbm_capacity_bytes: 1000000000000000000000000000000 is outside"):
        chips.merge_chips({"npu": {"hbm_capacity_bytes": 10**30}})


@pytest.mark.parametrize("field,value", [("elementwise_bytes_per_second", 1e-308), ("clock_hz", 5e-324),
                                         ("kernel_overhead_seconds", 1e9), ("peak_flops_per_second_bf16", 1e300),
                                         ("ici_torus_dims", 10**6)])
def test_a_figure_beyond_what_a_chip_can_be_is_refused(field, value):
    with pytest.raises(SpecError) as e:
        chips.merge_chips({"tpu-v5e": {field: value}})
    assert e.value.issues[0].startswith(f"chips.tpu-v5e.{field}: ") and "outside what one chip's figure" in str(e.value)
    with pytest.raises(SpecError, match=r"matmul_flops_per_second.bf16: 1e-308 is outside"):
        chips.merge_chips({"tpu-v5e": {"matmul_flops_per_second": {"bf16": 1e-308}}})


def test_one_chip_named_twice_in_two_cases_is_refused_where_the_second_is():
    assert _spec_issues("  TPU-V5E: {peak_flops_per_second_bf16: 1.0e+14}\n"
                        "  tpu-v5e: {peak_flops_per_second_bf16: 2.0e+14}\n") == [
        "s.yaml:4:3: chips.tpu-v5e: the same chip as 'TPU-V5E' (chip names are read in lower case); give its figures "
        "once"]
    with pytest.raises(SpecError, match="chips.tpu-v5e: the same chip as 'TPU-V5E'"):
        chips.merge_chips({"TPU-V5E": {"clock_hz": 1e9}, "tpu-v5e": {"clock_hz": 2e9}})


def test_a_profile_measured_on_another_chip_is_refused():
    issues = _spec_issues("  tpu-v5e:\n    matmul_flops_per_second: {bf16: 7.5e+14}\n"
                          "    profile: {measured_on: NVIDIA H100 80GB HBM3}\n")
    assert issues == [
        "s.yaml:4:37: chips.tpu-v5e.matmul_flops_per_second.bf16: 7.5e+14 FLOP/s is above tpu-v5e's peak bf16 rate "
        "(1.97e+14): no matmul runs faster than the peak (an MFU over 100%); a profile of another chip? (give "
        "peak_flops_per_second_bf16 too if the peak differs)",
        "s.yaml:5:28: chips.tpu-v5e.profile.measured_on: 'NVIDIA H100 80GB HBM3' is a h100-sxm, not a tpu-v5e: a "
        "profile measured on another chip; put it under chips.h100-sxm (or calibrate on a tpu-v5e)"]
    # its own kind, and a faster peak given beside the rate, are accepted
    ok = chips.merge_chips({"tpu-v5e": {"matmul_flops_per_second": {"bf16": 3e14}, "peak_flops_per_second_bf16": 3.1e14,
                                        "profile": {"measured_on": "TPU v5 lite"}}})["tpu-v5e"]
    assert ok.matmul_rate("bf16") == 3e14


def test_a_new_chip_without_an_hbm_figure_says_the_memory_part_is_left_out():
    from stagetool.analysis.step_time import _parts_without_figures

    npu = chips.merge_chips({"npu": {"peak_flops_per_second_bf16": 1e14}})["npu"]
    assert _parts_without_figures(npu) == ("no HBM bandwidth for npu: each kernel's memory time is left out (counted "
                                           "as 0 s); give chips.npu.hbm_bandwidth_bytes_per_second")
    mem = chips.merge_chips({"mem": {"hbm_copy_bytes_per_second": 1e12}})["mem"]
    assert _parts_without_figures(mem).startswith("no FLOP rate for mem: each kernel's compute time is left out")
    assert _parts_without_figures(chips.CHIPS["h100-sxm"]) is None
