"""Measuring on the attached accelerator (issue 39: ``stagetool calibrate``, ``cost --measure``, the
profiler's per-instruction times), tested on the CPU backend: the statistics and the timing loop with a
fake clock, the profiler trace reader on a hand-made trace, the chip profile's YAML, the refusals (exit 2),
and --measure end to end on a tiny program (the figures are the CPU's; the logic is the chip's)."""

from __future__ import annotations

import dataclasses
import textwrap
from types import SimpleNamespace

import pytest
import yaml
from helpers import run_cli  # noqa: F401 - fixture

from stagetool.measure.calibrate import BenchmarkResult, Calibration, calibrate, profile_yaml
from stagetool.measure.timing import Timing, summarize, time_calls
from stagetool.measure.trace import device_module_seconds, device_op_seconds, hlo_name


def test_summarize_gives_the_median_the_extremes_and_the_relative_spread():
    t = summarize([0.003, 0.001, 0.002, 0.010], inner=4, warmup=2)
    assert (t.median_seconds, t.min_seconds, t.max_seconds) == (0.0025, 0.001, 0.010)
    assert t.spread == pytest.approx((0.010 - 0.001) / 0.0025)
    assert (t.samples, t.inner, t.warmup) == (4, 4, 2)
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize([0.1, float("nan")])


def test_time_calls_warms_up_then_sizes_its_samples_from_the_last_warm_up_call():
    now, calls = [0.0], []

    def call():  # each call "takes" 2 ms on the fake clock
        calls.append(1)
        now[0] += 0.002

    t = time_calls(call, warmup=2, repeats=5, target_sample_seconds=0.02, clock=lambda: now[0], block=lambda out: out)
    assert t.inner == 10  # 20 ms of samples / 2 ms per call
    assert len(calls) == 2 + 5 * 10
    assert t.median_seconds == pytest.approx(0.002) and t.spread == pytest.approx(0.0, abs=1e-9)
    fixed = time_calls(call, warmup=0, repeats=3, inner=1, clock=lambda: now[0], block=lambda out: out)
    assert (fixed.inner, fixed.samples, fixed.warmup) == (1, 3, 0)
    # no warm-up and no inner count: one call sizes the samples (5 ms of samples / 2 ms: 2 calls each)
    del calls[:]
    sized = time_calls(call, warmup=0, repeats=4, target_sample_seconds=0.005, clock=lambda: now[0],
                       block=lambda out: out)
    assert (sized.inner, sized.samples, len(calls)) == (2, 4, 1 + 4 * 2)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_calls(call, repeats=0, block=lambda out: out)


def _ev(name, ns, **stats):
    return SimpleNamespace(name=name, duration_ns=ns, stats=list(stats.items()))


def _trace():
    tpu_ops = [_ev("%fusion.3 = bf16[8]{0} fusion(bf16[8]{0} %x), kind=kLoop, calls=%f", 3000),
               _ev("%fusion.3 = bf16[8]{0} fusion(bf16[8]{0} %x), kind=kLoop, calls=%f", 1000),
               _ev("%copy.1 = f32[4]{0} copy(f32[4]{0} %y)", 500)]
    device = SimpleNamespace(name="/device:TPU:0", lines=[SimpleNamespace(name="XLA Ops", events=tpu_ops),
                                                          SimpleNamespace(name="XLA Modules",
                                                                          events=[_ev("jit_f", 6000), _ev("jit_f", 4000)])])
    host = SimpleNamespace(name="/host:CPU", lines=[SimpleNamespace(name="python", events=[_ev("f", 99000)])])
    return SimpleNamespace(planes=[host, device])


def test_the_trace_reader_sums_device_instructions_by_hlo_name_per_step():
    assert hlo_name("%fusion.3 = bf16[8]{0} fusion(...)") == "fusion.3" and hlo_name("dot.1") == "dot.1"
    ops = device_op_seconds(_trace(), steps=2)
    assert ops == {"copy.1": (pytest.approx(0.25e-6), 0), "fusion.3": (pytest.approx(2e-6), 1)}
    assert device_module_seconds(_trace(), steps=2) == pytest.approx(5e-6)  # (6 + 4) µs over 2 steps


def test_on_the_cpu_backend_the_trace_reader_falls_back_to_hlo_op_host_events():
    host = SimpleNamespace(name="/host:CPU", lines=[SimpleNamespace(name="tf_XLA", events=[
        _ev("ynn_fusion", 2000, hlo_op="ynn_fusion", hlo_module="jit_f"), _ev("ThreadpoolListener::Record", 0)])])
    space = SimpleNamespace(planes=[host])
    assert device_op_seconds(space, steps=1) == {"ynn_fusion": (pytest.approx(2e-6), 1)}
    assert device_module_seconds(space, steps=1) is None


def _calibration(results):
    return Calibration(chip="tpu-v5e", device_kind="TPU v5 lite", platform="tpu", devices=1,
                       versions={"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"}, date="2026-12-06",
                       command="stagetool calibrate -o tpu-v5e.yaml", results=tuple(results),
                       notes=("one device: collectives not measured",))


def test_the_profile_yaml_reads_back_as_the_contract_s_chips_entry():
    t = Timing(0.006113, 0.0061, 0.00615, 0.008, 10, 3, 2)
    flops = 2.0 * 8192**3
    cal = _calibration([BenchmarkResult("matmul_bf16", "matmul_flops_per_second.bf16", "bf16[8192,8192] @ ...", flops,
                                        "FLOP", t, flops / t.median_seconds),
                        BenchmarkResult("hbm_copy", "hbm_copy_bytes_per_second", "copy f32[67108864]", 2 * 2.0**28,
                                        "byte", t, 2 * 2.0**28 / t.median_seconds),
                        BenchmarkResult("dispatch", None, "f32[8] + 1", 1.0, "second", t, t.median_seconds)])
    text = profile_yaml(cal)
    entry = yaml.safe_load(text)["chips"]["tpu-v5e"]
    assert entry["matmul_flops_per_second"]["bf16"] == pytest.approx(flops / 0.006113, rel=1e-4)
    assert isinstance(entry["hbm_copy_bytes_per_second"], float)
    assert entry["hbm_copy_bytes_per_second"] == pytest.approx(2 * 2.0**28 / 0.006113, rel=1e-4)
    assert entry["matmul_tile"] == [128, 128]
    assert entry["profile"] == {"measured_on": "TPU v5 lite", "date": "2026-12-06", "jax": "0.10.2",
                                "jaxlib": "0.10.2", "libtpu": "0.0.42.1", "command": "stagetool calibrate -o tpu-v5e.yaml"}
    assert "dispatch" not in entry and "#   dispatch: 6113 µs" in text  # shape classes are comments only
    assert "median 6.113 ms of 10×3 calls, spread 0.8%" in text
    from stagetool.core.chips import Chip, merge_chips

    if "matmul_flops_per_second" not in {f.name for f in dataclasses.fields(Chip)}:
        pytest.skip("the chip table does not have the calibrated fields yet (model39's Chip)")
    chip = merge_chips(yaml.safe_load(text)["chips"])["tpu-v5e"]
    assert dict(chip.matmul_flops_per_second)["bf16"] == pytest.approx(flops / 0.006113, rel=1e-4)
    assert chip.hbm_copy_bytes_per_second == pytest.approx(2 * 2.0**28 / 0.006113, rel=1e-4)


def test_calibrate_times_each_benchmark_and_its_rate_is_the_analytic_work_over_the_median():
    cal = calibrate(chip="test-cpu", command="test", size="tiny", repeats=3, warmup=1,
                    only=frozenset({"matmul_bf16", "elementwise", "scatter_add"}))
    by = {r.name: r for r in cal.results}
    assert list(by) == ["matmul_bf16", "elementwise", "scatter_add"]
    assert by["matmul_bf16"].work == 2 * 128**3  # SIZES["tiny"]["mm"]
    assert by["elementwise"].work == 3 * 4096 * 4  # x, y read and the result written, f32
    assert by["scatter_add"].work == 3 * 256 * 16 * 4
    for r in cal.results:
        assert r.timing.samples == 3 and r.timing.min_seconds <= r.timing.median_seconds <= r.timing.max_seconds
        assert r.rate == r.work / r.timing.median_seconds
    assert cal.figures() == {"matmul_flops_per_second": {"bf16": by["matmul_bf16"].rate},
                             "elementwise_bytes_per_second": by["elementwise"].rate,
                             "scatter_bytes_per_second": by["scatter_add"].rate}
    assert any("CPU backend" in n for n in cal.notes)


_CUMSUM_BENCH = """HloModule jit_cumsum, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%scan (p: f32[512,64,128]) -> f32[512,64,128] {
  %p = f32[512,64,128]{0,1,2:T(8,128)} parameter(0)
  %z = f32[] constant(0)
  ROOT %rw = f32[512,64,128]{0,1,2:T(8,128)} reduce-window(%p, %z), window={size=1x1x128 pad=0_0x0_0x127_0}, to_apply=%add
}

ENTRY %main (x: f32[512,64,128]) -> f32[512,64,128] {
  %x = f32[512,64,128]{2,1,0:T(8,128)} parameter(0)
  %copy.1 = f32[512,64,128]{0,1,2:T(8,128)} copy(%x), backend_config={"window_config":{"estimated_cycles":"1"}}
  %fusion = f32[512,64,128]{0,1,2:T(8,128)} fusion(%copy.1), kind=kOutput, calls=%scan
  ROOT %copy.2 = f32[512,64,128]{2,1,0:T(8,128)} copy(%fusion), backend_config={"window_config":{"estimated_cycles":"1"}}
}
"""


def test_calibrate_measures_a_set_scatters_rows_a_second():
    """class_rates.scatter_set_rows: rows set at unsorted ids into a donated bf16 table of 512-byte rows, its
    work the rows (SIZES tiny: lookups 256 -> 128 rows)."""
    cal = calibrate(chip="test-cpu", command="test", size="tiny", repeats=3, warmup=1, only=frozenset({"scatter_set"}))
    (r,) = cal.results
    assert r.key == "class_rates.scatter_set_rows" and r.work == 128 and r.rate == r.work / r.timing.median_seconds
    assert cal.figures() == {"class_rates": {"scatter_set_rows": r.rate}}


def test_a_class_rate_leaves_out_the_models_time_of_the_benchmarks_other_kernels():
    """Issue 46: calibrate's cumsum rate was its bytes over the whole program's 6.27 ms, four layout copies and a
    broadcast included, which the model times again as kernels of their own: a cumsum counted twice (the fit
    half's cumsum_rows +26%, cummax_cols +115%). others_seconds is the model's time of the kernels outside the
    class (here two vector-unit copies at the v5e's copy rate); the rate is work over the median less it."""
    import stagetool.measure.calibrate as cal_mod
    from stagetool.core.chips import CHIPS

    v5e = CHIPS["tpu-v5e"]
    nbytes = 512 * 64 * 128 * 4
    copies = 2 * (2 * nbytes / v5e.hbm_copy_bytes_per_second + v5e.kernel_overhead_seconds)
    assert cal_mod.others_seconds(_CUMSUM_BENCH, ("cumulative",), "TPU v5 lite") == pytest.approx(copies, rel=1e-9)
    assert cal_mod.others_seconds(_CUMSUM_BENCH, ("cumulative",), "cpu") == 0.0  # no chip table entry: nothing

    def build():
        return (lambda: None), 1e9, "a cumsum", _CUMSUM_BENCH

    timing = Timing(1e-3, 0.9e-3, 1.2e-3, 0.3, 3, 1, 1)
    run = cal_mod._program("cumulative", "class_rates.cumulative", "byte", build, own=("cumulative",))
    orig = cal_mod.others_seconds
    try:
        cal_mod.others_seconds = lambda text, own, kind: 0.4e-3 if own == ("cumulative",) else 0.0
        r = run(lambda call: timing)
    finally:
        cal_mod.others_seconds = orig
    assert r.others_seconds == 0.4e-3 and r.rate == pytest.approx(1e9 / 0.6e-3, rel=1e-12)
    try:  # the v5e's cumsum: 4.29 of its 6.27 ms are copies (68%), taken off whole; at most 90% of the median
        cal_mod.others_seconds = lambda text, own, kind: 0.68e-3
        assert run(lambda call: timing).rate == pytest.approx(1e9 / 0.32e-3, rel=1e-12)
        cal_mod.others_seconds = lambda text, own, kind: 5e-3
        assert run(lambda call: timing).others_seconds == pytest.approx(0.9e-3)
    finally:
        cal_mod.others_seconds = orig
    assert "less 0.4 ms the step-time model gives its other kernels" in profile_yaml(Calibration(
        chip="x", device_kind="TPU v5 lite", platform="tpu", devices=1, versions={}, date="2026-12-06",
        command="c", results=(r,)))


def test_calibrate_refuses_the_cpu_backend_before_any_work(run_cli):
    r = run_cli("calibrate", check=2)
    assert "none is attached" in r.stderr and "CPU" in r.stderr and r.stdout == ""
    r = run_cli("calibrate", "--format", "toml", check=2)
    assert "--format toml" in r.stderr


@pytest.fixture
def tiny_step(tmp_path, monkeypatch):
    (tmp_path / "step.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp

        def step(x, w, ids):
            return jnp.tanh(x @ w).sum() + x[ids].sum()
        """))
    (tmp_path / "step.stagetool.yaml").write_text(textwrap.dedent("""
        version: 1
        mesh: {axes: {data: 1}}
        functions:
          step:
            target: step.py:step
            args: ['f32[64,64]', 'f32[64,64]', 'i32[16]']
        """))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_measure_refuses_a_compile_only_target_before_staging(run_cli, tiny_step):
    r = run_cli("cost", "--spec", "step.stagetool.yaml", "--topology", "v5e:1x1", "--measure", check=2)
    assert "--measure" in r.stderr and "compile-only" in r.stderr and "--topology v5e:1x1" in r.stderr
    assert r.stdout == ""


def test_cost_measure_runs_the_step_and_puts_measured_beside_the_estimate(run_cli, tiny_step):
    doc = run_cli("cost", "--spec", "step.stagetool.yaml", "--chip", "tpu-v5e", "--measure", "--measure-steps", "3",
                  "--format", "json", check=0).json()
    f = doc["functions"][0]
    m, est = f["measured"], f["cost"]["step_time"]
    assert m["label"] == "measured" and m["platform"] == "cpu" and m["steps"] == 3 and m["warmup"] == 2
    assert 0 < m["min_seconds"] <= m["median_seconds"] <= m["max_seconds"]
    assert m["device_seconds"] is None  # the CPU backend's trace has no device plane
    assert m["estimated_seconds"] == est["schedule_seconds"] and m["estimate_chip"] == "tpu-v5e"
    assert m["error"] == pytest.approx((est["schedule_seconds"] - m["median_seconds"]) / m["median_seconds"])
    assert any("CPU backend" in n for n in m["notes"]) and any("[0, 1024)" in n for n in m["notes"])
    top = {i["name"]: i["total_seconds"] for i in est["top"]}
    assert m["instructions"], m["instructions_reason"]
    for i in m["instructions"]:
        assert i["measured_seconds"] >= 0 and i["estimated_seconds"] == top.get(i["name"])
    assert any(i["estimated_seconds"] is not None for i in m["instructions"])  # the same HLO names both sides
    text = run_cli("cost", "--spec", "step.stagetool.yaml", "--measure", "--measure-steps", "2", check=0).stdout
    assert "measured vs estimated (--measure)" in text and "step (wall clock)" in text and "CPU backend" in text


def test_concrete_inputs_draw_integers_below_int_high_and_keep_dtypes():
    import jax
    import jax.numpy as jnp

    from stagetool.measure.step import concrete_inputs

    tree = {"ids": jax.ShapeDtypeStruct((4096,), jnp.int32), "x": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16),
            "flag": jax.ShapeDtypeStruct((16,), jnp.bool_), "n": 3}
    out = concrete_inputs(tree, 0, int_high=50)
    assert int(out["ids"].min()) >= 0 and int(out["ids"].max()) < 50 and len(set(out["ids"].tolist())) > 40
    assert out["x"].dtype == jnp.bfloat16 and out["flag"].dtype == jnp.bool_ and out["n"] == 3
    assert 0 < int(out["flag"].sum()) < 16
    # zero integers and booleans (bench/bench_step_time.py's inputs), the same floats from the same seed
    zeros = concrete_inputs(tree, 0, int_high=50, random_integers=False)
    assert not bool(zeros["ids"].any()) and not bool(zeros["flag"].any()) and zeros["ids"].dtype == jnp.int32
    assert bool((zeros["x"] == out["x"]).all()) and zeros["n"] == 3


@pytest.mark.slow
def test_calibrate_cli_writes_a_profile_with_every_single_device_key(run_cli):
    """The whole command on the CPU backend (hidden --cpu-for-tests: tiny sizes, figures meaningless)."""
    r = run_cli("calibrate", "--cpu-for-tests", "--name", "test-cpu", "--repeats", "3", "--warmup", "1", check=0)
    entry = yaml.safe_load(r.stdout)["chips"]["test-cpu"]
    assert set(entry["matmul_flops_per_second"]) == {"bf16", "f32", "f32_highest", "int8"}
    keys = {"hbm_copy_bytes_per_second", "elementwise_bytes_per_second", "reduction_bytes_per_second",
            "transcendentals_per_second", "gather_bytes_per_second", "scatter_bytes_per_second"}
    assert keys <= set(entry) and all(entry[k] > 0 for k in keys)
    # the kernel overhead is a key, or (measured as 0 on a busy host: noise) a comment saying why
    assert entry.get("kernel_overhead_seconds", 0) > 0 or "# kernel_overhead_seconds: " in r.stdout
    from stagetool.core.chips import merge_chips

    assert merge_chips(yaml.safe_load(r.stdout)["chips"])["test-cpu"].hbm_copy_bytes_per_second > 0  # it loads
    import jax

    if len(jax.devices()) > 1:  # the test session's simulated CPU devices: the all-reduce benchmark runs
        assert entry["collective_latency_seconds"] > 0 and "all_reduce_latency" in r.stderr
    else:
        assert "collective_latency_seconds" not in entry
    assert entry["profile"]["measured_on"] == "cpu" and entry["profile"]["jax"]
    assert "matmul_tile" not in entry  # the MXU tile is a TPU's
    assert "measured on the CPU backend" in r.stdout and "matmul_bf16" in r.stderr


def test_time_pipelined_runs_one_warm_step_then_the_steps_back_to_back():
    """StepRunner.time_pipelined: one blocked step first, then ``steps`` calls issued without blocking
    between them (a donated input made anew for each beforehand), seconds per step."""
    import jax
    import jax.numpy as jnp

    from stagetool.measure.step import StepRunner

    seen = []

    def compiled(x):
        seen.append(x)
        return x * 2

    staged = SimpleNamespace(compiled=compiled, jitted=compiled)
    inputs = SimpleNamespace(args=(jax.ShapeDtypeStruct((4,), jnp.float32),), kwargs={}, static_argnames=(),
                             donate_argnums=(0,), donate_argnames=())
    runner = StepRunner(staged, inputs)
    seconds = runner.time_pipelined(steps=5)
    assert seconds > 0 and len(seen) == 1 + 5
    # every call had an input of its own (a donated one is consumed), each the same values (the same seed)
    assert len({id(x) for x in seen}) == 6 and all(bool((x == seen[0]).all()) for x in seen)
    assert runner.args == (None,)  # no master copy of a donated input is kept


def test_step_runner_keeps_one_set_of_donated_inputs_alive_and_shares_the_others():
    """Issue 46: a paged decode whose donated pool is half the chip died RESOURCE_EXHAUSTED because each step's
    copy of the donated input lived beside the master copy. Now a donated input exists once per step (made anew),
    nothing from an earlier step is alive, and an input nobody donates is made once and shared."""
    import jax
    import jax.numpy as jnp

    from stagetool.measure.step import StepRunner

    import gc

    # jax.live_arrays() is the process's: a shape no other test makes, and no garbage of earlier tests
    # (under xdist a worker's earlier test left arrays of (64, 8) alive: live == [2, ...]).
    pool_shape, live, shared = (37, 11), [], []
    gc.collect()

    def compiled(pool, w):
        live.append(sum(1 for a in jax.live_arrays() if a.shape == pool_shape and not a.is_deleted()))
        shared.append(w)
        return pool + 1.0, w.sum()

    staged = SimpleNamespace(compiled=compiled, jitted=compiled)
    inputs = SimpleNamespace(args=(jax.ShapeDtypeStruct(pool_shape, jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32)),
                             kwargs={}, static_argnames=(), donate_argnums=(0,), donate_argnames=())
    runner = StepRunner(staged, inputs)
    assert runner.donated_bytes == 37 * 11 * 4
    runner.time(steps=4, warmup=1)
    assert live == [1] * 5, live  # only the step's own pool; the old runner kept a master copy too: 2
    runner.profile(2)  # the profiled steps' pools made beforehand, where they fit together (the CPU: no figures)
    assert max(live[5:]) <= 2
    assert len({id(w) for w in shared}) == 1  # the undonated input made once


def test_out_of_memory_while_measuring_is_one_line_naming_the_function():
    """--measure's out-of-memory line is the general one (core.errors.out_of_memory, which an
    escaped one gets too) with the function and its inputs' size."""
    from stagetool.core.errors import known_failure, out_of_memory

    e = RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.00G. That was "
                     "not possible. There are 3.10G free.\nmore detail")
    assert out_of_memory(ValueError("x")) is None
    msg = out_of_memory(e, who="--measure: paged_decode_big", inputs_bytes=8.2 * 2**30).message
    assert msg == ("--measure: paged_decode_big ran out of device memory on the attached device (its inputs take "
                   "8.20 GiB): RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.00G. "
                   "That was not possible. There are 3.10G free.")
    assert msg.partition(" ran out ")[2].replace(" (its inputs take 8.20 GiB)", "") == \
        known_failure(e).message.partition(" ran out ")[2]
    assert out_of_memory(MemoryError(), who="--measure: f").message == "--measure: f ran out of host memory: MemoryError"


def test_measure_says_at_least_beside_an_estimate_that_is_a_floor(run_cli, tiny_step):
    """Issue 47 item 3: a sort timed at a floor made the estimate a lower bound, and --measure's error read
    like the model's (-99% against the measured step, no "at least"). It reads "at least" and "≥" now."""
    (tiny_step / "step.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp

        def step(x, w, ids):
            return jnp.sort(jnp.tanh(x @ w), axis=-1).sum() + x[ids].sum()
        """))
    doc = run_cli("cost", "--spec", "step.stagetool.yaml", "--chip", "tpu-v5e", "--measure", "--measure-steps", "2",
                  "--format", "json", check=0).json()
    f = doc["functions"][0]
    m, est = f["measured"], f["cost"]["step_time"]
    assert est["lower_bound"] and m["estimate_lower_bound"] is True
    assert m["error"] == pytest.approx((est["schedule_seconds"] - m["median_seconds"]) / m["median_seconds"])
    floors = {u["name"] for u in est["uncounted"]}
    assert all(i["estimate_lower_bound"] == (i["name"] in floors) for i in m["instructions"])
    text = run_cli("cost", "--spec", "step.stagetool.yaml", "--chip", "tpu-v5e", "--measure", "--measure-steps", "2",
                   check=0).stdout
    (row,) = [ln for ln in text.splitlines() if "step (wall clock)" in ln]
    assert "at least" in row and "≥ " in row, row
    assert "the estimate is a lower bound" in text


def test_measured_rows_write_a_floor_as_at_least():
    from stagetool.report.model import MeasuredInstruction, MeasuredSection
    from stagetool.report.views import measured_rows

    m = MeasuredSection("1 × TPU v5 lite", "tpu", 1e-3, 1e-3, 1e-3, 0.0, 3, 2, 1e-3, 1e-5, "tpu-v5e", -0.99,
                        (MeasuredInstruction("sort.7", 9e-4, 1, 8e-6, True), MeasuredInstruction("dot.1", 1e-4, 1, 1e-4)),
                        estimate_lower_bound=True)
    _, rows = measured_rows(m)
    assert rows[1][2:4] == ["at least 10.0 µs", "≥ -99%"]
    assert rows[2][2:4] == ["at least 8.00 µs", "≥ -99%"] and rows[3][2:4] == ["100 µs", "+0%"]
    _, rows = measured_rows(dataclasses.replace(m, estimate_lower_bound=False))
    assert rows[1][2:4] == ["10.0 µs", "-99%"]


def test_calibrate_measures_the_classes_held_back_round_2_showed():
    """Issue 46, held-back round 2: scatter-adds at unique regular ids and as segment sums (rows a second), the
    upsample gradient (its gradient's bytes), scalar gathers and scatter-adds against a small table (elements),
    transposed and strided convolutions at small sizes (XLA's FLOPs). Tiny sizes on the CPU: the work is each
    program's analytic count, the profile the spec's chips: loader takes back."""
    import math

    from stagetool.core.chips import CLASS_RATES, merge_chips
    from stagetool.measure.calibrate import SIZES

    names = {"scatter_add_unique_512B", "scatter_add_segment_4B", "scatter_add_upsample", "gather_scalar_vmem",
             "scatter_add_scalar_vmem", "conv_transposed_8px", "conv_strided_4x4"}
    cal = calibrate(chip="test-cpu", command="test", size="tiny", repeats=3, warmup=1, only=frozenset(names))
    by = {r.name: r for r in cal.results}
    assert set(by) == names
    t = SIZES["tiny"]
    assert by["scatter_add_unique_512B"].work == t["lookups"] == 256  # rows
    assert by["scatter_add_segment_4B"].work == 256
    b, h, c = t["img"], t["hw"] // 2, t["ch"]
    # its scatters' update bytes: the rows' pass adds the whole upsampled gradient, the columns' pass half of it
    # (XLA:CPU adds bf16 in f32: 4 bytes an element here; XLA:TPU scatters bf16)
    assert by["scatter_add_upsample"].work == 1.5 * b * (2 * h) ** 2 * c * 4
    assert by["gather_scalar_vmem"].work == by["scatter_add_scalar_vmem"].work == 2 * 2 * 256  # elements
    # a transposed 4x4 stride-2 convolution of bf16[4,8,8,16] -> 8: XLA's FLOPs, as JAX's own cost analysis of the
    # same call gives them, at most the 2 x (16 x 16 output pixels x 4 images) x 8 x 16 x (4 x 4 / 4) multiply-adds
    # of its taps on the stride-2 grid (SAME padding drops some at the edges)
    import jax
    import jax.numpy as jnp

    x, w = jnp.zeros((4, 8, 8, 16), jnp.bfloat16), jnp.zeros((4, 4, 16, 8), jnp.bfloat16)
    ca = jax.jit(lambda x, w: jax.lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                 ).lower(x, w).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    assert by["conv_transposed_8px"].work == ca["flops"] <= 2 * 4 * 16 * 16 * 8 * 16 * 4
    assert by["conv_transposed_8px"].key is None  # a point of the shape ladder: JSON and comments only
    for r in cal.results:
        assert r.rate == pytest.approx(r.work / (r.timing.median_seconds - r.others_seconds), rel=1e-12)
        assert math.isfinite(r.rate) and r.rate > 0
    rates = cal.figures()["class_rates"]
    assert set(rates) == {"scatter_add_unique_512", "scatter_add_segment_4", "scatter_add_upsample",
                          "gather_scalar_vmem", "scatter_add_scalar_vmem", "conv_strided_4x4"}
    assert set(rates) <= set(CLASS_RATES)
    chip = merge_chips({"test-cpu": {"hbm_copy_bytes_per_second": 1e11, "class_rates": rates}})["test-cpu"]
    assert chip.class_rate("gather_scalar_vmem") == by["gather_scalar_vmem"].rate


def test_the_coverage_benchmarks_count_their_work_analytically():
    """Issue 46's class coverage: element ops chained over one array (elements x chain), max pooling's window (bytes
    of bf16[2,8,8,8] read, its pooled bf16[2,4,4,8] written), an interleaving pad (f32[16,128] read, f32[31,128]
    written), top-k's operand elements and a loop's iterations (SIZES tiny); each rate is work over the median."""
    names = {"op_exponential", "op_divide_s32", "pool_max", "pad_interior", "top_k", "loop_iteration"}
    cal = calibrate(chip="test-cpu", command="test", size="tiny", repeats=2, warmup=1, only=frozenset(names))
    by = {r.name: r for r in cal.results}
    assert set(by) == names
    assert by["op_exponential"].work == by["op_divide_s32"].work == 1024 * 2
    assert by["pool_max"].work == 2 * 8 * 8 * 8 * 2 + 2 * 4 * 4 * 8 * 2
    assert by["pad_interior"].work == 16 * 128 * 4 + 31 * 128 * 4
    assert by["top_k"].work == 4 * 256 and by["loop_iteration"].work == 4
    for r in cal.results:  # the CPU: no chip table entry, nothing taken off the median
        assert r.others_seconds == 0.0 and r.rate == r.work / r.timing.median_seconds
    assert by["pool_max"].key == "class_rates.pool_window" and by["loop_iteration"].key == "class_rates.loop_iterations"
    from stagetool.core.chips import CLASS_RATES

    assert {r.key.split(".", 1)[1] for r in cal.results} <= set(CLASS_RATES)
