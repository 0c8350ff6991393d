"""What the user's code and the environment must not do to stagetool's output and exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
from helpers import REPO, write


def test_prints_in_user_code_do_not_corrupt_the_payload(run_cli, tmp_path):
    write(tmp_path, "p.py", """\
        print("importing p")

        def f(x):
            print("tracing f")
            return x * 2
    """)
    spec = write(tmp_path, "p.stagetool.yaml", "functions:\n  f: {target: p.py:f, args: ['f32[4]']}\n")
    r = run_cli("lower", "--spec", str(spec), check=0)
    assert r.stdout.startswith("module @jit_f") and "tracing f" not in r.stdout
    assert "importing p" in r.stderr and "tracing f" in r.stderr
    r = run_cli("shardings", "--spec", str(spec), "--format", "json", check=0)
    assert r.json()["functions"][0]["name"] == "f"


def test_an_unexpected_exception_is_one_line_and_exit_3(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "q.py", "def f(x):\n    return x + 1\n")
    spec = write(tmp_path, "q.stagetool.yaml", "functions:\n  f: {target: q.py:f, args: ['f32[4]']}\n")

    def broken(self):
        raise RuntimeError("INTERNAL: the backend fell over\nsecond line")

    monkeypatch.setattr(jax.stages.Compiled, "as_text", broken)
    r = run_cli("compile", "--spec", str(spec))
    assert r.code == 3 and "Traceback" not in r.stderr
    assert "error: unexpected RuntimeError: INTERNAL: the backend fell over" in r.stderr
    assert "second line" not in r.stderr and "--debug" in r.stderr


def test_loops_and_16_bit_inputs_on_cpu_are_flagged(run_cli, tmp_path):
    write(tmp_path, "s.py", """\
        import jax
        import jax.numpy as jnp

        def f(ws, x):
            def body(x, w):
                return jnp.tanh(x @ w), None
            return jax.lax.scan(body, x, ws)[0]
    """)
    spec = write(tmp_path, "s.stagetool.yaml", "functions:\n  f: {target: s.py:f, args: ['bf16[4,64,64]', 'bf16[8,64]']}\n")
    doc = run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", "--format", "json", check=0).json()
    f = doc["functions"][0]
    assert f["cost"]["loop_trip_counts"] == [4]
    assert f["cost"]["roofline"]["dtype"] == "bf16"
    assert any(n.startswith("XLA:CPU computes bf16 dot products in f32") for n in f["notes"])
    text = run_cli("cost", "--spec", str(spec), check=0).stdout
    assert "1 while loop (trip count 4): XLA's cost analysis counts a loop body once" in text


def test_f32_roofline_uses_the_f32_peak_where_published(run_cli, tmp_path):
    write(tmp_path, "m.py", "def f(a, b):\n    return a @ b\n")
    spec = write(tmp_path, "m.stagetool.yaml", "functions:\n  f: {target: m.py:f, args: ['f32[64,64]', 'f32[64,64]']}\n")
    gpu = run_cli("cost", "--spec", str(spec), "--chip", "a100-80gb", "--format", "json", check=0).json()
    assert gpu["functions"][0]["cost"]["roofline"]["dtype"] == "f32"
    assert gpu["functions"][0]["cost"]["roofline"]["peak_flops_per_second"] == 19.5e12
    tpu = run_cli("cost", "--spec", str(spec), "--chip", "tpu-v5e", "--format", "json", check=0).json()
    assert tpu["functions"][0]["cost"]["roofline"]["dtype"] == "bf16"  # TPUs publish no f32 peak


def test_a_cpu_run_prints_nothing_on_stderr_in_a_fresh_process():
    """With libtpu installed (as `.ci/run` does) but no TPU, its start-up warnings must not show."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    r = subprocess.run([sys.executable, "-m", "stagetool", "shardings", "examples/mlp.py:train_step", "--format",
                        "json", "-o", os.devnull], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == f"wrote {os.devnull}", r.stderr


def test_processes_without_local_avals_is_a_usage_error(run_cli):
    r = run_cli("shardings", str(REPO / "examples" / "mlp.py") + ":train_step", "--processes", "2")
    assert r.code == 2 and "--processes 2 simulates hosts for local avals" in r.stderr and "--local-avals" in r.stderr


def test_out_shardings_that_do_not_fit_the_outputs_are_a_spec_error(run_cli, tmp_path):
    write(tmp_path, "o.py", "def f(x):\n    return x, x * 2\n")
    spec = write(tmp_path, "o.stagetool.yaml", """\
        mesh: {axes: {data: 2}}
        functions:
          f:
            target: o.py:f
            args: ['f32[8] @ [data]']
            out_shardings: [[data], [data], [data]]
    """)
    r = run_cli("shardings", "--spec", str(spec))
    assert r.code == 2 and "o.stagetool.yaml:6:" in r.stderr and "out_shardings" in r.stderr
    assert "Traceback" not in r.stderr
    write(tmp_path, "o.stagetool.yaml", """\
        mesh: {axes: {data: 2}}
        functions:
          f:
            target: o.py:f
            args: ['f32[8] @ [data]']
            out_shardings: [[data], replicated]
    """)
    outs = run_cli("shardings", "--spec", str(spec), "--format", "json", check=0).json()["functions"][0]["outputs"]
    assert [(x["declared"], x["compiled"]) for x in outs] == [("P('data')", "P('data')"), ("P(None)", "P(None)")]  # padded to rank


def test_a_narrow_terminal_never_cuts_a_cell(run_cli_shared, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    out = run_cli_shared("shardings", str(REPO / "examples" / "transformer.py") + ":train_step", check=0).stdout
    assert "…" not in out
    row = next(line for line in out.splitlines() if line.startswith(" opt_state/v/layers/w_down "))
    assert "f32[2,1024,256]" in row and "P(None, 'model', None)" in row and "[2,256,256]" in row and "512 KiB" in row
    assert all(line == line.rstrip() for line in out.splitlines())


_LONG = "decoder/encoderdecoderblock_1/MultiHeadDotProductAttention_0/query_projection_with_a_long_name"


def test_piped_and_file_text_keep_every_cell_of_a_wide_table(run_cli, tmp_path, monkeypatch):
    """Text that goes to a pipe or a file (not a terminal) is as wide as its table's cells need:
    a ~100-character leaf path, a compiled sharding over two axes and the notes column are whole,
    past the 200 columns a terminal's table may ask for (before: the compiled sharding ended in
    "…" and the notes column was dropped)."""
    monkeypatch.setenv("COLUMNS", "160")
    write(tmp_path, "wide.py", f"""
        import jax.numpy as jnp


        def f(params, x):
            w = params["{_LONG}"]
            return {{"{_LONG}": w * 2.0}}, (x @ w).sum()
    """)
    spec = write(tmp_path, "wide.stagetool.yaml", f"""
        mesh: {{axes: {{data: 2, fsdp: 2, model: 2}}}}
        functions:
          f:
            target: wide.py:f
            args:
              - {{"{_LONG}": 'f32[64,32] @ [[data, fsdp], null]'}}
              - 'f32[16,64] @ [[data, fsdp], null]'
            donate: [0]
    """)
    piped = run_cli("shardings", "--spec", str(spec), check=0).stdout
    run_cli("shardings", "--spec", str(spec), "-o", str(tmp_path / "sh.txt"), check=0)
    for out in (piped, (tmp_path / "sh.txt").read_text()):
        assert "…" not in out
        row = next(line for line in out.splitlines() if line.startswith(f" params/{_LONG} "))
        assert len(row) > 200, row
        assert row.count("P(('data', 'fsdp'), None)") == 2 and "[16,32]" in row and "2.00 KiB" in row, row
        assert row.rstrip().endswith("donated"), row  # the notes column is there
        header = next(line for line in out.splitlines() if line.lstrip().startswith("leaf "))
        assert "per device" in header


def test_piped_text_folds_the_op_column_a_terminal_cuts(run_cli, tmp_path):
    """The collectives' op column is cut at 40 columns with "…" on a terminal; piped, the long op
    name folds onto a continuation line and is whole."""
    out = run_cli("collectives", str(REPO / "examples" / "linen_lm.py") + ":train_step", "--cache-dir",
                  str(tmp_path / "cache"), check=0).stdout
    assert "…" not in out
    assert "transpose(jvp(LM))/Embed_0.attend/dot_general" in "".join(line.strip() for line in out.splitlines())


def test_zero_device_memory_is_a_usage_error(run_cli):
    r = run_cli("memory", str(REPO / "examples" / "mlp.py") + ":train_step", "--no-peak", "--device-memory", "0")
    assert r.code == 2 and "more than 0 bytes" in r.stderr


def test_fail_if_over_without_a_known_capacity_is_a_usage_error(run_cli):
    r = run_cli("memory", str(REPO / "examples" / "mlp.py") + ":train_step", "--no-peak", "--fail-if-over")
    assert r.code == 2 and "--fail-if-over needs the device memory" in r.stderr and "--device-memory" in r.stderr
