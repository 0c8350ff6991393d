"""Hostile runs over the families of issue 35; prints accidental passes, hangs and unexpected errors.

Each run feeds one hostile input to stagetool and judges the outcome against what it must be:

- an **accidental pass**: stagetool accepted what it must refuse (a config whose sizes are 0, a
  forged report believed, a late ``os._exit(0)`` that turned a regression into exit 0);
- a **hang**: the run did not end within its bound (a FIFO read, a regex that backtracks for ever,
  a run a signal could not end);
- an **unexpected error**: an exception other than stagetool's own errors, "unexpected" or a
  traceback on stderr, an exit code outside the documented set, something left behind.

Families, in process (fast; hangs are caught in a forked child with a deadline) unless noted:
``gpu-config`` (mutated ``GpuTargetConfigProto`` texts, special files), ``regex`` (generated rule
patterns: refused, or matched against adversarial names in bounded time), ``topology`` (names with
non-ASCII digits, huge counts), ``timeout`` (``--timeout`` values), ``report`` (forged supervisor
reports), ``spec`` (lone surrogates anywhere in a spec), ``cache`` (the cache's subfolders),
``stray`` (temporaries of dead, zombie and live writers), and ``cli``: whole ``python -m stagetool``
runs (late exits, closed standard streams, a daemon left at import, signals, GPU configs through the
commands, ``why`` selectors, topology strings, huge counts, ``--resume`` FIFOs).

    python bench/bench_hostile.py [--seed 0] [--scale 1.0] [--jobs 2] [--no-cli]

``--scale`` multiplies the number of in-process runs (1.0: about 560 runs in all, ~5 min on 2 busy
cores). Exit status 1 when any run was bad.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OK, PASS, HANG, UNEXPECTED = "ok", "accidental pass", "hang", "unexpected"


@dataclasses.dataclass(frozen=True)
class Outcome:
    family: str
    name: str
    verdict: str
    detail: str = ""


def in_child(fn: Callable[[], str], limit_s: float) -> tuple[str, str]:
    """Run ``fn`` in a forked child with a deadline: (its verdict, detail), or (HANG, ...) when it
    did not end in time (it is then killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            verdict = fn()
        except BaseException as e:  # noqa: BLE001
            verdict = f"{UNEXPECTED}\t{type(e).__name__}: {e}"
        os.write(w, verdict.encode("utf-8", "backslashreplace")[:4000])
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return HANG, f"still running after {limit_s:g} s"
    with os.fdopen(r, "rb") as fh:
        said = fh.read().decode("utf-8", "replace")
    verdict, _, detail = said.partition("\t")
    return (verdict or UNEXPECTED), detail


# ---- gpu-config ----------------------------------------------------------------------------------


def gpu_config_cases(rng: random.Random, n: int, work: Path) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.core.errors import UsageError
    from stagetool.plan.gpu_target_proto import POSITIVE_FIELDS, read_target_config_file
    from stagetool.devices.gpu_topology import gpu_model, target_config_text

    base = target_config_text(gpu_model("h100"))
    bad_values = ["0", "-1", "-2147483648", "nan", "inf", "-inf", "-0", "0.0", "9223372036854775808", "1e400",
                  "0x0", "'12'", "true"]

    def field_line(text: str, name: str) -> re.Match | None:
        return re.search(rf"(?m)^(\s*){name}: .*$", text)

    def case(kind: str, text: str, must: str, want_memory: int | None = None) -> Callable[[], str]:
        def run() -> str:
            p = Path(tempfile.mkdtemp(dir=work)) / "c.txtpb"
            p.write_text(text, encoding="utf-8", errors="surrogatepass")
            try:
                cfg = read_target_config_file(p)
            except UsageError:
                return OK if must in ("refuse", "either") else f"{UNEXPECTED}\trefused a valid config"
            except Exception as e:  # noqa: BLE001
                return f"{UNEXPECTED}\t{type(e).__name__}: {e}"
            if must == "refuse":
                return f"{PASS}\taccepted ({kind})"
            if want_memory is not None and cfg.memory_bytes != want_memory:
                return f"{PASS}\tcapacity {cfg.memory_bytes}, the field says {want_memory}"
            return OK
        return run

    out = []
    for i in range(n):
        kind = rng.choice(["bad-value", "missing", "comment", "duplicate", "garbage", "truncate", "capacity",
                           "unknown-field", "nesting"])
        text, must, want = base, "either", None
        name = rng.choice(POSITIVE_FIELDS)
        m = field_line(text, name)
        if kind == "bad-value":
            value = rng.choice(bad_values if name != "clock_rate_ghz" else [v for v in bad_values if v[0] != "9"])
            text = text[:m.start()] + f"{m.group(1)}{name}: {value}" + text[m.end():]
            must = "refuse"
        elif kind == "missing":
            text = text[:m.start()] + text[m.end() + 1:]
            must = "refuse"
        elif kind == "comment":  # the field only in a comment: missing, whatever the comment says
            text = text[:m.start()] + f"{m.group(1)}# {name}: 999999999999" + text[m.end():]
            must = "refuse"
        elif kind == "duplicate":
            text = text[:m.end()] + f"\n{m.group(1)}{name}: 7" + text[m.end():]
            must = "refuse"
        elif kind == "garbage":
            pos = rng.randrange(len(text))
            junk = "".join(rng.choice("{}[]<>:#\"'\\\x00\x1b\u202e\udc80 x9") for _ in range(rng.randint(1, 6)))
            text = text[:pos] + junk + text[pos:]
        elif kind == "truncate":
            text = text[:rng.randrange(len(text))]
        elif kind == "capacity":
            want = rng.choice([1, 1000, 2**40, 2**62])
            text = "# device_memory_size: 999999999999999\n" + text.replace("85899345920", str(want))
            must = "accept"
        elif kind == "unknown-field":
            text = text + rng.choice(['autotune_results { version: 3 }\n', "not_a_field: 3\n", "gpu_device_info { }\n"])
            must = "either"
        else:
            depth = rng.choice([10, 100, 10000])
            text = text + "x " + "{ " * depth + "}" * depth + "\n"
        out.append((f"{kind}:{name}", case(kind, text, must, want)))
    for special in ("fifo", "dev_zero", "folder", "huge", "not-utf8", "empty"):
        def run(special: str = special) -> str:
            d = Path(tempfile.mkdtemp(dir=work))
            p = d / "c"
            if special == "fifo":
                os.mkfifo(p)
            elif special == "folder":
                p.mkdir()
            elif special == "dev_zero":
                p = Path("/dev/zero")
            elif special == "huge":
                p.write_bytes(base.encode() + b"#" * (5 * 2**20))
            elif special == "not-utf8":
                p.write_bytes(base.encode() + b"\xff\xfe")
            else:
                p.write_bytes(b"")
            try:
                read_target_config_file(p)
            except UsageError:
                return OK
            return f"{PASS}\taccepted {special}"
        out.append((f"special:{special}", run))
    return out


# ---- regex ---------------------------------------------------------------------------------------


def regex_cases(rng: random.Random, n: int) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.core.patterns import backtracking_risk

    atoms = [".", "a", "w", "\\w", "\\d", "[a-z]", "[^/]", "/", "(?:wq|wk)", "(a|a)", "(a|ab)", "x?"]
    quants = ["", "", "*", "+", "?", "{2}", "{20}", "{1,}", "*?", "{0,3}"]

    def pattern(depth: int = 0) -> str:
        parts = []
        for _ in range(rng.randint(1, 4)):
            if depth < 3 and rng.random() < 0.35:
                parts.append("(" + pattern(depth + 1) + ")" + rng.choice(quants))
            else:
                parts.append(rng.choice(atoms) + rng.choice(quants))
        return "".join(parts)

    subjects = ["a" * 30 + "!", "w" * 40 + "b", "p/" + "a/" * 20 + "!", "params/layers_0/attn/wq", "/" * 40 + "x",
                "ab" * 20 + "c"]

    def case(p: str) -> Callable[[], str]:
        def run() -> str:
            risk = backtracking_risk(p)
            if risk is not None:
                return OK  # refused (exit 2 naming it)
            try:
                compiled = re.compile(p)
            except re.error:
                return OK  # refused as a bad regular expression
            for s in subjects:
                compiled.search(s)
            return OK
        return run

    out = [(p, case(p)) for p in (pattern() + rng.choice(["", "$"]) for _ in range(n))]
    out += [(p, case(p)) for p in ("(.*a){20}$", "(\\w+)*$", "(a+)+$", "((a)*)*$", "(.*){9}$", "(?:x+)+y")]
    return out


# ---- topology, timeout, report, spec, cache, stray ---------------------------------------------------------


def topology_cases(rng: random.Random, n: int) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.core.errors import UsageError
    from stagetool.plan.target import parse_target

    digits = ["2", "8", "0", "\uff18", "\u0668", "\u00b2", "\u2468", "9" * 7, "9" * 5000, "65537", " 4 "]
    kinds = ["v5e", "v4", "h100", "gpu", "a100-80gb", "", " ", "v5e\u200b", "h\u0131100"]

    out = []
    for _ in range(n):
        form = rng.choice(["{k}:{a}", "{k}:{a}x{b}", "{k}:{a}x{b}x{c}", "{k}={a}x{b}", "{a}", ""])
        name = form.format(k=rng.choice(kinds), a=rng.choice(digits), b=rng.choice(digits), c=rng.choice(digits))

        def run(name: str = name) -> str:
            try:
                count = parse_target(name).device_count
            except UsageError:
                return OK
            bad = (not name.strip() or any(c.isdigit() and not c.isascii() for c in name) or count > 2**16
                   or count < 1)
            return f"{PASS}\t{name[:40]!r} gave {count} devices" if bad else OK
        out.append((repr(name[:30]), run))
    return out


def timeout_cases() -> list[tuple[str, Callable[[], str]]]:
    from stagetool.core.errors import UsageError
    from stagetool.core.units import timeout_seconds
    from stagetool.sweep.driver import timeout_s

    values = [math.inf, -math.inf, math.nan, 0, -0.0, -1, 1e308, 604801, 10**400 if False else 1e300, 5e-324, 7.5,
              604800, True, "5"]
    out = []
    for v in values:
        for fn in (timeout_seconds, timeout_s):
            def run(v=v, fn=fn) -> str:
                good = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= 604800
                try:
                    got = fn(v)
                except UsageError:
                    return OK if not good else f"{UNEXPECTED}\trefused {v!r}"
                return OK if good and got == float(v) else f"{PASS}\t{v!r} accepted as {got!r}"
            out.append((f"{fn.__name__}({v!r})", run))
    return out


def report_cases(rng: random.Random, n: int) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.process.supervise import verdict

    out = []
    for _ in range(n):
        nonce = os.urandom(16).hex()
        code = rng.choice([0, 1, 2, 3])
        status_code = rng.choice([0, 0, code, 1, 3])
        said = rng.choice([
            f"{nonce} {code}\n", f"{nonce} {code}\n{nonce} 0\n", "0\n", f"{os.urandom(16).hex()} 0\n",
            f"{nonce} 0\n" * 2, f"{nonce} \uff10\n", f"{nonce} 00\n", f"{nonce}  0\n", "", f"{nonce} -0\n",
            f"{nonce} {code}", f"{nonce} 256\n"])
        signalled = rng.random() < 0.15

        def run(nonce=nonce, code=code, status_code=status_code, said=said, signalled=signalled) -> str:
            status = signal.SIGKILL if signalled else status_code << 8
            with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                got = verdict(status, said.encode("utf-8"), nonce)
            honest = said.strip() == f"{nonce} {code}" and not signalled and status_code == code and "\n" not in said.strip()
            if got == 0 and not (honest and code == 0):
                return f"{PASS}\t{said!r} with status {status} gave 0"
            if honest and got != code:
                return f"{UNEXPECTED}\tan honest report of {code} gave {got}"
            return OK
        out.append((repr(said[:20]), run))
    return out


def spec_cases(rng: random.Random, n: int) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.core.errors import SpecError
    from stagetool.spec.parse import parse_spec

    template = ('mesh: {axes: {data: 2}}\nfunctions:\n  "F":\n    target: "m.py:fT"\n    args: ["f32[8] @ [data]", "f32[4]D"]\n'
                '    static: {k: "S"}\n')
    out = []
    for _ in range(n):
        where = rng.choice("FTDS")
        s = rng.choice(["\\ud800", "\\udfff", "\\udc80x", "a\\ud83d"])
        text = template.replace(f'{where}"', f'{s}"').replace('T"', '"').replace('D"', '"').replace('"F"', '"f"') \
            .replace('"S"', '"s"')

        def run(text=text) -> str:
            try:
                parse_spec(text, file="s.yaml")
            except SpecError as e:
                return OK if "surrogate" in e.message else f"{UNEXPECTED}\t{e.message[:120]}"
            except Exception as e:  # noqa: BLE001
                return f"{UNEXPECTED}\t{type(e).__name__}: {e}"
            return f"{PASS}\ta spec with a lone surrogate was accepted"
        out.append((f"surrogate in {where}", run))
    return out


def cache_cases(work: Path) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.staging import cache as cache_mod

    states = ["missing", "0700", "0755", "0770", "0777", "0720", "link", "file", "fifo"]
    out = []
    for top in states:
        for sub in ("missing", "0700", "0777", "link"):
            def run(top=top, sub=sub) -> str:
                d = Path(tempfile.mkdtemp(dir=work))
                os.environ[cache_mod.SECRET_ENV] = str(d / "key")
                root = d / "cache"
                c = cache_mod.FactsCache.open(root)
                if c is None:
                    return f"{UNEXPECTED}\tno cache in a fresh folder"
                key = "cd" * 32
                facts, other = root / "facts", d / "other"
                other.mkdir(mode=0o700)
                (other / key[:2]).mkdir(mode=0o700)
                if top == "link":
                    facts.symlink_to(other)
                elif top == "file":
                    facts.write_text("x")
                elif top == "fifo":
                    os.mkfifo(facts)
                elif top != "missing":
                    facts.mkdir()
                    os.chmod(facts, int(top, 8))
                if top not in ("missing", "link", "file", "fifo") and sub != "missing":
                    if sub == "link":
                        (facts / key[:2]).symlink_to(other / key[:2])
                    else:
                        (facts / key[:2]).mkdir()
                        os.chmod(facts / key[:2], int(sub, 8))
                with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                    trusted = c._folders_trusted(key)
                safe_top = top in ("missing", "0700", "0755")
                safe_sub = top == "missing" or sub in ("missing", "0700")
                if trusted and not (safe_top and safe_sub):
                    return f"{PASS}\tfacts {top}, facts/{key[:2]} {sub} trusted"
                if not trusted and safe_top and safe_sub and top != "0755":
                    return f"{UNEXPECTED}\ta safe layout ({top}, {sub}) refused"
                return OK
            out.append((f"facts {top} / sub {sub}", run))
    return out


def stray_cases(work: Path) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.process import fileio

    out = []
    for writer in ("zombie", "dead", "alive", "self", "other-name") * 2:
        def run(writer=writer) -> str:
            d = Path(tempfile.mkdtemp(dir=work))
            proc = None
            if writer == "self":
                pid = os.getpid()
            else:
                proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                pid = proc.pid
                if writer in ("zombie", "dead"):
                    proc.kill()
                    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        time.sleep(0.01)
                    if writer == "dead":
                        proc.wait()
            name = "out.json" if writer != "other-name" else "else.json"
            stray = d / f".{name}.{pid}.x1y2.tmp"
            stray.write_text("half")
            try:
                fileio.write_atomic(d / "out.json", "whole")
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            gone = not stray.exists()
            should_go = writer in ("zombie", "dead")
            if gone != should_go:
                return f"{PASS if not gone else UNEXPECTED}\t{writer}'s temporary {'removed' if gone else 'kept'}"
            return OK
        out.append((writer, run))
    return out


# ---- whole runs of the command -------------------------------------------------------------------------

MODEL = """\
import atexit
import os
import threading
import time

WHERE = os.environ.get("WHERE", "")
if WHERE == "atexit":
    atexit.register(lambda: os._exit(0))
if WHERE == "daemon":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    os.wait()
if WHERE == "stuck":
    import re, sys
    print("stuck", file=sys.stderr, flush=True)
    re.match("(.*a){25}$", "a" * 40 + "b")


def f(x):
    if WHERE == "thread":
        def late():
            time.sleep(2)
            os._exit(0)
        threading.Thread(target=late, daemon=False).start()
    if WHERE == "slow":
        import sys
        print("slow", file=sys.stderr, flush=True)
        time.sleep(600)
    return x * 2


def g(x, mode):
    return x * 2


class Boom(BaseException):
    pass


def boom(x):
    class Local(BaseException):
        pass
    raise Local("inner")
"""


@dataclasses.dataclass(frozen=True)
class CliCase:
    name: str
    args: tuple[str, ...]
    codes: tuple[int, ...]  # the exit codes it may end with
    env: tuple[tuple[str, str], ...] = ()
    shell: str = ""  # redirections (``1>&-``)
    stderr_has: str = ""
    stdout_has: str = ""
    signal_on: str = ""  # a stderr line to wait for, then signal_num is sent
    signal_num: int = 0
    limit_s: float = 150.0
    pre: str = ""  # a setup step: "fifo-row", "lock16"


def cli_cases(work: Path, plugin: bool) -> list[CliCase]:
    H = ("H100",)
    cases = [
        CliCase("late atexit", ("check", "-b", "lock.json", "--spec", "big.yaml"), (1,), (("WHERE", "atexit"),)),
        CliCase("late atexit --jobs 2", ("check", "-b", "lock.json", "--spec", "big.yaml", "--jobs", "2"), (1,),
                (("WHERE", "atexit"),)),
        CliCase("late thread", ("check", "-b", "lock.json", "--spec", "big.yaml"), (1,), (("WHERE", "thread"),)),
        CliCase("os._exit unchanged atexit", ("check", "-b", "lock.json"), (0,), (("WHERE", "atexit"),)),
        CliCase("daemon at import", ("check", "-b", "lock.json", "--spec", "big.yaml"), (1,), (("WHERE", "daemon"),),
                stderr_has="left behind", limit_s=120),
        CliCase("stdout closed", ("check", "-b", "lock.json"), (2,), shell="1>&-", stderr_has="stdout is closed"),
        CliCase("stderr closed", ("check", "-b", "lock.json"), (0,), shell="2>&-"),
        CliCase("stdin closed", ("check", "-b", "lock.json"), (0,), shell="0<&-"),
        CliCase("all closed", ("check", "-b", "lock.json"), (2,), shell="0<&- 1>&- 2>&-"),
        CliCase("stderr closed regression", ("check", "-b", "lock.json", "--spec", "big.yaml"), (1,), shell="2>&-"),
        CliCase("SIGTERM in trace", ("snapshot", "-o", "x.json"), (143,), (("WHERE", "slow"),), signal_on="slow",
                signal_num=signal.SIGTERM, stderr_has="terminated (SIGTERM)"),
        CliCase("SIGINT in trace", ("snapshot", "-o", "x.json"), (130,), (("WHERE", "slow"),), signal_on="slow",
                signal_num=signal.SIGINT, stderr_has="interrupted (SIGINT)"),
        CliCase("SIGHUP in trace", ("snapshot", "-o", "x.json"), (129,), (("WHERE", "slow"),), signal_on="slow",
                signal_num=signal.SIGHUP, stderr_has="(SIGHUP)"),
        CliCase("SIGHUP --isolate", ("snapshot", "--isolate", "-o", "x.json"), (129,), (("WHERE", "slow"),),
                signal_on="slow", signal_num=signal.SIGHUP, stderr_has="(SIGHUP)"),
        CliCase("SIGTERM stuck in a regex", ("shardings",), (143,), (("WHERE", "stuck"),), signal_on="stuck",
                signal_num=signal.SIGTERM, stderr_has="terminated (SIGTERM)"),
        CliCase("SIGINT stuck in a regex", ("shardings",), (130,), (("WHERE", "stuck"),), signal_on="stuck",
                signal_num=signal.SIGINT, stderr_has="interrupted (SIGINT)"),
        CliCase("rule regex catastrophic", ("shardings", "--spec", "rx.yaml"), (2,), stderr_has="exponential time",
                limit_s=60),
        CliCase("why --collective 99999", ("why", "--collective", "99999", "--spec", "two.yaml"), (2,)),
        CliCase("why --line nofile.py:3", ("why", "--line", "nofile.py:3", "--spec", "two.yaml"), (2,)),
        CliCase("why --line /etc/passwd:1", ("why", "--line", "/etc/passwd:1", "--spec", "two.yaml"), (2,)),
        CliCase("--topology ''", ("shardings", "--topology", ""), (2,), stderr_has="--topology"),
        CliCase("--topology full-width", ("shardings", "--topology", "v5e:\uff12x\uff12"), (2,)),
        CliCase("--topology huge", ("shardings", "--topology", "v5e:" + "9" * 5000), (2,)),
        CliCase("--mesh huge", ("shardings", "--mesh", "data=" + "9" * 5000, "--spec", "two.yaml"), (2,)),
        CliCase("--jobs huge", ("snapshot", "-o", "x.json", "--jobs", "9" * 5000), (2,)),
        CliCase("--timeout 1e308", ("check", "-b", "lock.json", "--timeout", "1e308"), (2,), stderr_has="--timeout"),
        CliCase("--timeout inf", ("check", "-b", "lock.json", "--timeout", "inf"), (2,), stderr_has="--timeout"),
        CliCase("--timeout nan", ("check", "-b", "lock.json", "--timeout", "nan"), (2,), stderr_has="--timeout"),
        CliCase("--timeout 1e400", ("sweep", "m.py:g", "--set", "mode=a", "--spec", "sw.yaml", "--timeout", "1e400"), (2,)),
        CliCase("isolate local BaseException", ("snapshot", "--spec", "boom.yaml", "--isolate", "-o", "y.json"), (3,),
                stderr_has="a BaseException"),
        CliCase("resume FIFO row", ("sweep", "m.py:g", "--spec", "sw.yaml", "--set", "mode=a", "--output-dir", "rows",
                                    "--resume"), (2,), pre="fifo-row", limit_s=90),
        CliCase("surrogate in spec", ("shardings", "--spec", "sur.yaml"), (2,), stderr_has="surrogate"),
        CliCase("devices --gpu-target-config, no topology", ("devices", "--gpu-target-config", "h100.txtpb"), (2,)),
    ]
    if plugin:
        cases += [
            CliCase("gpu config FIFO", ("devices", "--topology", "gpu:2", "--gpu-target-config", "fifo.txtpb"), (2,),
                    limit_s=60),
            CliCase("gpu config /dev/zero", ("memory", "--topology", "gpu:2", "--mesh", "data=2", "--spec", "two.yaml",
                                            "--gpu-target-config", "/dev/zero"), (2,), limit_s=60),
            CliCase("gpu config comment capacity", ("memory", "--topology", "gpu:2", "--mesh", "data=2", "--spec",
                                                   "wide.yaml", "--gpu-target-config", "tiny.txtpb", "--fail-if-over"),
                    (1,), limit_s=150),
            CliCase("gpu config threads_per_warp 0", ("shardings", "--topology", "gpu:2", "--mesh", "data=2", "--spec",
                                                     "two.yaml", "--gpu-target-config", "warp0.txtpb"), (2,)),
            CliCase("gpu config no memory", ("devices", "--topology", "gpu:2", "--gpu-target-config", "nomem.txtpb"), (2,)),
            CliCase("sweep gpu config zero", ("sweep", "m.py:g", "--spec", "sw.yaml", "--set", "mode=a", "--topology",
                                             "gpu:2", "--gpu-target-config", "warp0.txtpb"), (2,)),
            CliCase("gpu markdown escaped", ("devices", "--topology", "gpu:2", "--gpu-target-config", "xss.txtpb",
                                            "--format", "markdown"), (0,)),
        ]
    return cases


def setup_cli(work: Path) -> None:
    from stagetool.devices.gpu_topology import gpu_model, target_config_text

    (work / "m.py").write_text(MODEL)
    (work / "m.stagetool.yaml").write_text("functions:\n  f: {target: m.py:f, args: ['f32[8]']}\n")
    (work / "big.yaml").write_text("functions:\n  f: {target: m.py:f, args: ['f32[16]']}\n")
    (work / "two.yaml").write_text("mesh: {axes: {data: 2}}\nfunctions:\n  f: {target: m.py:f, args: ['f32[8] @ [data]']}\n")
    (work / "wide.yaml").write_text("mesh: {axes: {data: 2}}\nfunctions:\n  f: {target: m.py:f, args: ['f32[4096] @ [data]']}\n")
    (work / "rx.yaml").write_text("functions:\n  f:\n    target: m.py:f\n    args: [{init: m.py:f, init_args: [1], "
                                  "rules: [['(.*a){20}$', replicated]]}]\n")
    (work / "boom.yaml").write_text("functions:\n  f: {target: m.py:boom, args: ['f32[8]']}\n")
    (work / "sw.yaml").write_text("functions:\n  g:\n    target: m.py:g\n    args: ['f32[8]']\n    static: {mode: ${mode}}\n")
    (work / "sur.yaml").write_text('functions:\n  "f\\ud800": {target: m.py:f, args: ["f32[8]"]}\n')
    h100 = target_config_text(gpu_model("h100"))
    (work / "h100.txtpb").write_text(h100)
    (work / "tiny.txtpb").write_text("# device_memory_size: 999999999999999\n" + h100.replace("85899345920", "1000"))
    (work / "warp0.txtpb").write_text(h100.replace("threads_per_warp: 32", "threads_per_warp: 0"))
    (work / "nomem.txtpb").write_text(h100.replace("  device_memory_size: 85899345920\n", ""))
    (work / "xss.txtpb").write_text(h100.replace('"NVIDIA H100 80GB HBM3"', '"<script>alert(1)</script>"'))
    env = _env(work)
    r = subprocess.run([sys.executable, "-m", "stagetool", "snapshot", "-o", "lock.json"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def _env(work: Path, extra: tuple[tuple[str, str], ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(COLUMNS="200", NO_COLOR="1", TERM="dumb", PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               STAGETOOL_NO_CACHE="1", PYTHONWARNINGS="ignore", TMPDIR=str(work / "tmp"))
    env.update(dict(extra))
    return env


def run_cli_case(case: CliCase, base: Path, index: int) -> Outcome:
    work = base / f"run{index}"
    shutil.copytree(base / "proto", work, symlinks=True)
    (work / "tmp").mkdir(exist_ok=True)
    os.mkfifo(work / "fifo.txtpb")  # (copytree copies no FIFO)
    if case.pre == "fifo-row":
        env = _env(work)
        subprocess.run([sys.executable, "-m", "stagetool", "sweep", "m.py:g", "--spec", "sw.yaml", "--set", "mode=a",
                        "--output-dir", "rows"], cwd=work, env=env, capture_output=True, timeout=300)
        (row,) = list((work / "rows").iterdir())
        row.unlink()
        os.mkfifo(row)
    argv = [sys.executable, "-m", "stagetool", *case.args]
    if case.shell:
        argv = ["sh", "-c", f'exec "$@" {case.shell}', "sh", *argv]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=work, env=_env(work, case.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err_lines: list[bytes] = []
    out = b""
    try:
        if case.signal_on:
            import threading

            reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr))
            reader.start()
            while not any(case.signal_on.encode() in ln for ln in err_lines):
                if proc.poll() is not None or time.monotonic() - start > case.limit_s:
                    break
                time.sleep(0.05)
            time.sleep(0.5)
            proc.send_signal(case.signal_num)
            out = proc.stdout.read()
            proc.wait(timeout=case.limit_s)
            reader.join(10)
        else:
            out, err = proc.communicate(timeout=case.limit_s)
            err_lines = [err]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Outcome("cli", case.name, HANG, f"still running after {case.limit_s:g} s")
    err_text = b"".join(err_lines).decode("utf-8", "replace")
    out_text = out.decode("utf-8", "replace")
    leftovers = [p.name for p in (work / "tmp").iterdir()]
    if "unexpected" in err_text or "Traceback" in err_text:
        return Outcome("cli", case.name, UNEXPECTED, err_text.strip().splitlines()[-1][:200])
    if proc.returncode not in case.codes:
        verdict = PASS if proc.returncode == 0 or (proc.returncode < case.codes[0] and case.codes[0] <= 3) else UNEXPECTED
        return Outcome("cli", case.name, verdict, f"exit {proc.returncode}, wanted {case.codes}: "
                       + " | ".join(err_text.strip().splitlines()[-2:])[:240])
    if case.stderr_has and case.stderr_has not in err_text:
        return Outcome("cli", case.name, UNEXPECTED, f"stderr lacks {case.stderr_has!r}: {err_text[-200:]!r}")
    if "<script>" in out_text:
        return Outcome("cli", case.name, PASS, "a device name reached the Markdown raw")
    if leftovers:
        return Outcome("cli", case.name, UNEXPECTED, f"left in TMPDIR: {leftovers[:3]}")
    return Outcome("cli", case.name, OK)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the number of in-process runs")
    ap.add_argument("--jobs", type=int, default=2, help="whole command runs at a time")
    ap.add_argument("--no-cli", action="store_true", help="leave out the whole command runs")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every bad run")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    n = lambda k: max(1, int(k * args.scale))  # noqa: E731
    outcomes: list[Outcome] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        work = Path(tmp)
        families = [
            ("gpu-config", gpu_config_cases(rng, n(150), work), 10.0),
            ("regex", regex_cases(rng, n(120)), 5.0),
            ("topology", topology_cases(rng, n(60)), 5.0),
            ("timeout", timeout_cases(), 5.0),
            ("report", report_cases(rng, n(60)), 5.0),
            ("spec", spec_cases(rng, n(30)), 10.0),
            ("cache", cache_cases(work), 10.0),
            ("stray", stray_cases(work), 20.0),
        ]
        for family, cases, limit in families:
            for name, fn in cases:
                verdict, detail = in_child(fn, limit)
                outcomes.append(Outcome(family, name, verdict, detail))
        if not args.no_cli:
            from stagetool.devices.gpu_topology import cuda_plugin_available

            proto = work / "proto"
            proto.mkdir()
            (proto / "tmp").mkdir()
            setup_cli(proto)
            shutil.rmtree(proto / "tmp")
            cases = cli_cases(work, cuda_plugin_available())
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                outcomes += list(pool.map(lambda ic: run_cli_case(ic[1], work, ic[0]), enumerate(cases)))
    seconds = time.monotonic() - start
    table = collections.defaultdict(collections.Counter)
    for o in outcomes:
        table[o.family][o.verdict] += 1
    print(f"{'family':<12} {'runs':>5} {'ok':>5} {'passes':>7} {'hangs':>6} {'unexpected':>11}")
    for family, counts in table.items():
        print(f"{family:<12} {sum(counts.values()):>5} {counts[OK]:>5} {counts[PASS]:>7} {counts[HANG]:>6} "
              f"{counts[UNEXPECTED]:>11}")
    total = collections.Counter(o.verdict for o in outcomes)
    print(f"{'all':<12} {len(outcomes):>5} {total[OK]:>5} {total[PASS]:>7} {total[HANG]:>6} {total[UNEXPECTED]:>11}"
          f"   ({seconds:.0f} s, seed {args.seed})")
    bad = [o for o in outcomes if o.verdict != OK]
    for o in bad if args.verbose or len(bad) <= 30 else bad[:30]:
        print(f"  {o.verdict}: {o.family} {o.name}: {o.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
