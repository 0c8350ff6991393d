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
    python bench/bench_hostile.py --round 4 [--seed 0] [--scale 1.0] [--limit 90]

``--round 4`` (issue 42) runs instead: ``chips`` (chip constants through ``merge_chips``: counts that
are fractions, zero, negative, NaN, text), ``live`` (``stagetool.inspect`` and ``LiveReport`` in a
driver process that stands for the caller: bad options and oversized leaves that must be refused
before any trace, functions that exit, fork, leave threads that exit, methods JAX cannot stage,
isolated runs, RSS over 60 ``peak=True`` calls; ``signals``: 16 functions that install handlers,
arm alarms and interval timers, block signals or interrupt themselves, in process and isolated, after
which the caller's handlers, timers and mask must be as before and SIGINT a ``KeyboardInterrupt``), ``fixture`` (a pytest project whose snapshot paths
are planted links, FIFOs and folders, then whose snapshots are mutated: every mutation must fail
the test, no file outside the snapshot folder may change) and ``process`` (a session whose staged
functions exit from threads or fork, in process and with ``--stagetool-isolate``). Its verdicts:
ok, data loss, passed regression, hang, caller death, unexpected.

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



# ==== round 4 (issue 42): the pytest fixture, inspect/LiveReport, isolation, chip constants ===========
#
# Verdicts of this round: ok, data loss (a file outside what stagetool owns was written), passed
# regression (a changed or missing snapshot, or a failing test, came out as a pass), hang (no end
# within the bound), caller death (the process that called stagetool ended), unexpected (a raw
# exception, a silently coerced option, a report for what must be refused).

LOSS, REGRESSION, DEATH = "data loss", "passed regression", "caller death"

LIVE_FNS = '''\
import multiprocessing
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


def ok(x):
    return jnp.tanh(x).sum()


def two(w, x):
    return (x @ w).sum()


def sys_exit_0(x):
    sys.exit(0)


def sys_exit_3(x):
    sys.exit(3)


def os_exit_0(x):
    os._exit(0)


def os_exit_1(x):
    os._exit(1)


def raises(x):
    raise ValueError("the user's own error")


class Boom(BaseException):
    pass


def boom(x):
    raise Boom("a BaseException of the user's")


def thread_exit_now(x):
    t = threading.Thread(target=os._exit, args=(0,))
    t.start()
    t.join()
    return x * 2


def thread_exit_later(x):
    def later():
        time.sleep(0.3)
        os._exit(0)

    threading.Thread(target=later).start()
    return x * 2


def daemon_exit_later(x):
    def later():
        time.sleep(0.3)
        os._exit(0)

    threading.Thread(target=later, daemon=True).start()
    return x * 2


def fork_child_exits(x):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return x * 2


def fork_child_sleeps(x):
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    os.waitpid(pid, 0)
    return x * 2


def fork_child_returns(x):
    os.fork()  # the child would run the caller's code on
    return x * 2


def fork_process(x):
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.1,))
    p.start()
    p.join()
    return x + 1


def fork_pool(x):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(abs, [1, 2, 3])
    return x + 1


def thread_forks_later(x):
    def later():
        time.sleep(0.2)
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)

    threading.Thread(target=later).start()
    return x * 2


# signals: what staged code does to the caller's handlers, timers and mask (a bound copy of a
# signal function reaches the process itself; stagetool must undo it)
from signal import alarm as bound_alarm, setitimer as bound_setitimer, signal as bound_signal  # noqa: E402


def swallow(signum, frame):
    print("swallowed", signum, flush=True)


def sig_swallow_int(x):
    signal.signal(signal.SIGINT, swallow)
    return x * 2


def sig_term_exits(x):
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    return x * 2


def sig_ignore_int(x):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return x * 2


def sig_many(x):
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(s, swallow)
    return x * 2


def sig_alarm(x):
    signal.alarm(1)
    return x * 2


def sig_itimer_real(x):
    signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
    return x * 2


def sig_itimer_prof(x):
    signal.setitimer(signal.ITIMER_PROF, 0.05, 0.05)  # SIGPROF's default ends the process
    return x * 2


def sig_bound_int(x):
    bound_signal(signal.SIGINT, swallow)
    return x * 2


def sig_bound_alarm(x):
    bound_alarm(1)
    return x * 2


def sig_bound_itimer(x):
    bound_setitimer(signal.ITIMER_VIRTUAL, 0.05, 0.05)  # SIGVTALRM's default ends the process
    return x * 2


def sig_mask(x):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    return x * 2


def sig_thread_alarm(x):
    t = threading.Thread(target=signal.alarm, args=(1,))
    t.start()
    t.join()
    return x * 2


def sig_interrupts(x):
    signal.signal(signal.SIGINT, swallow)
    os.kill(os.getpid(), signal.SIGINT)  # the caller's SIGINT: KeyboardInterrupt
    time.sleep(0.3)
    return x * 2


def sig_consistent(x):
    old = signal.signal(signal.SIGINT, swallow)
    if signal.getsignal(signal.SIGINT) is not swallow:
        raise AssertionError("getsignal does not answer what signal.signal set")
    signal.signal(signal.SIGINT, old)
    return x * 2


def sig_alarm_handler(x):
    signal.signal(signal.SIGALRM, lambda s, f: sys.exit(0))
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    time.sleep(0.1)
    return x * 2


def sig_bad_number(x):
    signal.signal(999, swallow)
    return x * 2
'''

LIVE_DRIVER = r'''
import json, os, pickle, random, signal, sys, time, gc
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
import stagetool
from stagetool.core.errors import StagetoolError
import hostile_fns as F

OK, REGRESSION, UNEXPECTED = "ok", "passed regression", "unexpected"
X = jax.ShapeDtypeStruct((8,), jnp.float32)
NAN = float("nan")
BAD = {
    "mesh": [{"data": 2.5}, {"data": True}, {"data": 0}, {"data": -3}, {"": 2}, {1: 2}, {"data": "2"},
             {"data": None}, "data=2.5", "data=", "=2", "data=2,data=2", "data=-1", 3, [("data", 2)], {"data": NAN},
             {"data": 2**100}, {}, "data=2**3", {"data": 1e3}],
    "donate": [True, False, -1, 1.5, [None], {"a": 1}, b"0", 99, "nope", [0, -2], NAN],
    "top": [2.5, True, -1, "3", None, float("inf")],
    "peak": ["no", 1, 0, None, "True"],
    "slices": [0, -1, 1.5, True, "2"],
    "platform": [3, "", "tpux", "cuda?", "\x00"],
    "topology": ["", "v5e:0x0", "v5e:2x", "zz:8", "v5e:99999x99999", "\udcff", 5, "v5e:2x4x4x4x4"],
    "chip": ["", "nope", 5, "tpu-v5e\x00", "\udcff"],
    "device_memory": [16, "-1GiB", "nanGiB", "0", "1e400GiB", "16XB", ""],
    "name": [5, "", b"x"],
    "explain": [5, [1], [None], ["("], ["no_such_leaf"], "(a+)+$"],
    "static": [5, [1], "nokw", {1: 2}],
    "isolate": ["yes", 1, None],
    "timeout_s": [-1, 0, NAN, float("inf"), "10", True],
}


def judge_refusal(call):
    try:
        r = call()
    except StagetoolError:
        return OK, ""
    except Exception as e:
        return UNEXPECTED, f"raw {type(e).__name__}: {e}"[:300]
    return UNEXPECTED, "accepted (a report)"


def judge_run(call, want):
    """want: 'report', 'error' (a StagetoolError), or 'either'."""
    try:
        r = call()
        r.functions
    except StagetoolError as e:
        return (OK, "") if want in ("error", "either") else (UNEXPECTED, f"{type(e).__name__}: {e.message[:200]}")
    except Exception as e:
        return UNEXPECTED, f"raw {type(e).__name__}: {e}"[:300]
    except F.Boom:  # the user's own BaseException, raised to the caller as it is
        return (OK, "") if want in ("error", "either") else (UNEXPECTED, "Boom")
    return (OK, "") if want in ("report", "either") else (REGRESSION, "a report for a function that failed")


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
           signal.SIGPROF, signal.SIGVTALRM)


def judge_signals(call, want):
    """want: 'report', 'error' or 'interrupt' (KeyboardInterrupt, as SIGINT does to the caller). After
    it: the caller's handlers, timers and mask as before, and SIGINT still a KeyboardInterrupt."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        r = call()
        r.functions
        got = "report"
    except StagetoolError:
        got = "error"
    except KeyboardInterrupt:
        got = "interrupt"
    except Exception as e:
        got = f"raw {type(e).__name__}: {e}"[:200]
    bad = []
    if got != want:
        bad.append(f"{got} where {want} was due")
    changed = [signal.Signals(s).name for s in SIGNALS if signal.getsignal(s) != before[s]]
    if changed:
        bad.append("handlers left: " + ", ".join(changed))
        for s in SIGNALS:
            signal.signal(s, before[s])
    timers = [w for w in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF) if signal.getitimer(w) != (0.0, 0.0)]
    if timers:
        bad.append(f"timers left armed: {timers}")
        for w in timers:
            signal.setitimer(w, 0)
    if signal.pthread_sigmask(signal.SIG_BLOCK, []) != mask:
        bad.append("signal mask left changed")
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        bad.append("SIGINT no longer interrupts the caller")
    except KeyboardInterrupt:
        pass
    return (UNEXPECTED, "; ".join(bad)) if bad else (OK, "")


def cases(seed, scale):
    rng = random.Random(seed)
    out = []
    for opt, values in BAD.items():
        for v in values:
            kw = {opt: v}
            out.append((f"option {opt}={v!r}", lambda kw=kw: judge_refusal(lambda: stagetool.inspect(F.ok, X, **kw))))
    for i in range(int(60 * scale)):
        opt = rng.choice(list(BAD))
        kw = {opt: rng.choice(BAD[opt])}
        other = rng.choice([o for o in BAD if o != opt])
        if other not in ("isolate", "timeout_s"):
            kw[other] = rng.choice(BAD[other])
        out.append((f"options {kw!r}", lambda kw=kw: judge_refusal(lambda: stagetool.inspect(F.ok, X, **kw))))
    for i in range(int(50 * scale)):
        big = rng.choice([2**33, 2**40, 2**58, 2**62, 2**32 + 1])
        dims = [rng.choice([1, 2, 3, 2**20, 2**31, 2**32]) for _ in range(rng.randint(1, 4))]
        dims.insert(rng.randrange(len(dims) + 1), big)
        n = 1
        for d in dims:
            n *= d
        if n <= 2**57 and max(dims) <= 2**32:
            dims.append(2**32)
            dims.append(2**32)
        shape = tuple(dims)
        leaf = jax.ShapeDtypeStruct(shape, rng.choice([jnp.float32, jnp.bfloat16, jnp.int8, jnp.complex64]))
        where = rng.choice(["x", "w-dict", "w-list", "kw"])
        if where == "x":
            call = lambda leaf=leaf: stagetool.inspect(F.ok, leaf)
        elif where == "w-dict":
            call = lambda leaf=leaf: stagetool.inspect(F.two, {"a": {"b": leaf}}, X)
        elif where == "w-list":
            call = lambda leaf=leaf: stagetool.inspect(F.two, [X, leaf], X)
        else:
            call = lambda leaf=leaf: stagetool.inspect(F.two, X, x=leaf)
        out.append((f"leaf {shape} in {where}", lambda call=call: judge_refusal(call)))
    funcs = [("sys_exit_0", "error"), ("sys_exit_3", "error"), ("os_exit_0", "error"), ("os_exit_1", "error"),
             ("raises", "error"), ("boom", "error"), ("thread_exit_now", "error"), ("thread_exit_later", "either"),
             ("daemon_exit_later", "either"), ("fork_child_exits", "report"), ("fork_child_sleeps", "report"),
             ("fork_child_returns", "report"), ("fork_process", "report"), ("fork_pool", "either"),
             ("thread_forks_later", "either"), ("ok", "report")]
    for name, want in funcs:
        for peak in (True, False):
            fn = getattr(F, name)
            out.append((f"function {name} peak={peak}",
                        lambda fn=fn, want=want, peak=peak: judge_run(lambda: stagetool.inspect(fn, X, peak=peak), want)))
    for meth in (np.ndarray.sum, np.ndarray.mean, np.ndarray.max, np.ndarray.reshape, list.append, len, print, dict):
        out.append((f"method {getattr(meth, '__qualname__', meth)}",
                    lambda meth=meth: judge_run(lambda: stagetool.inspect(meth, jnp.zeros(4)), "either")))
    for name, want in (("os_exit_0", "error"), ("thread_exit_later", "either"), ("fork_child_sleeps", "report"),
                       ("fork_process", "report"), ("ok", "report"), ("sys_exit_3", "error")):
        fn = getattr(F, name)
        out.append((f"isolated {name}",
                    lambda fn=fn, want=want: judge_run(lambda: stagetool.inspect(fn, X, isolate=True, timeout_s=120),
                                                       want)))

    for name, want in (("sig_swallow_int", "report"), ("sig_term_exits", "report"), ("sig_ignore_int", "report"),
                       ("sig_many", "report"), ("sig_alarm", "report"), ("sig_itimer_real", "report"),
                       ("sig_itimer_prof", "report"), ("sig_bound_int", "report"), ("sig_bound_alarm", "report"),
                       ("sig_bound_itimer", "report"), ("sig_mask", "report"), ("sig_thread_alarm", "report"),
                       ("sig_interrupts", "interrupt"), ("sig_consistent", "report"), ("sig_alarm_handler", "report"),
                       ("sig_bad_number", "error")):
        fn = getattr(F, name)
        for isolate in (False, True):
            out.append((f"signals {name}{' isolated' if isolate else ''}",
                        lambda fn=fn, want=want, isolate=isolate: judge_signals(
                            lambda: stagetool.inspect(fn, X, isolate=isolate, peak=False), want)))

    def report_reads():
        r = stagetool.inspect(F.two, jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((2, 8), jnp.float32))
        bad = []
        for what, call, ok_errors in (
                ("function('nope')", lambda: r.function("nope"), (KeyError,)),
                ("why(leaf='zz')", lambda: r.why(leaf="zz"), (StagetoolError, LookupError, ValueError)),
                ("why(leaf='(')", lambda: r.why(leaf="("), (StagetoolError, LookupError, ValueError)),
                ("pickle", lambda: pickle.loads(pickle.dumps(r)).functions, ()),
                ("html", lambda: r._repr_html_(), ()),
                ("memory", lambda: r.memory, ()), ("collectives", lambda: r.collectives, ()),
                ("cost", lambda: r.cost, ()), ("shardings", lambda: r.shardings, ())):
            try:
                call()
            except ok_errors:
                pass
            except Exception as e:
                bad.append(f"{what}: raw {type(e).__name__}: {e}"[:200])
        return (UNEXPECTED, "; ".join(bad)) if bad else (OK, "")

    out += [(f"LiveReport reads {i}", report_reads) for i in range(3)]

    def memory():
        def rss():
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        for _ in range(10):
            stagetool.inspect(F.two, w, x, peak=True).functions
        gc.collect()
        before = rss()
        for _ in range(60):
            stagetool.inspect(F.two, w, x, peak=True).functions
        gc.collect()
        grown = (rss() - before) / 60
        return (OK, f"{grown / 1024:.1f} KiB a call") if grown < 64 * 1024 else (UNEXPECTED, f"RSS grows {grown / 1024:.1f} KiB a call")

    out.append(("memory: 60 inspect calls peak=True", memory))
    return out


def main():
    seed, scale, start = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    all_cases = cases(seed, scale)
    if start < 0:
        print(json.dumps({"count": len(all_cases)}), flush=True)
        return
    me = os.getpid()
    for i in range(start, len(all_cases)):
        name, run = all_cases[i]
        print(json.dumps({"begin": i, "name": name}), flush=True)
        try:
            verdict, detail = run()
        except BaseException as e:
            verdict, detail = UNEXPECTED, f"escaped: {type(e).__name__}: {e}"[:300]
        if os.getpid() != me:  # a forked child came back into the caller's code
            os._exit(0)
        print(json.dumps({"end": i, "verdict": verdict, "detail": detail, "pid": me}), flush=True)
    time.sleep(1.0)  # a thread left running gets its chance to end this process
    print(json.dumps({"alive": me}), flush=True)


if __name__ == "__main__":
    main()
'''


def live_round(work: Path, seed: int, scale: float, limit_s: float) -> list[Outcome]:
    """Every inspect/LiveReport/isolation case, run one after another in a driver process (the
    caller's process: its death or a hang is charged to the case it was on, and a new driver takes
    the next)."""
    import json
    import select

    folder = work / "live"
    folder.mkdir()
    (folder / "hostile_fns.py").write_text(LIVE_FNS)
    (folder / "driver.py").write_text(LIVE_DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)]), "JAX_PLATFORMS": "cpu",
           "STAGETOOL_NO_CACHE": "1"}
    env.pop("XLA_FLAGS", None)
    count = json.loads(subprocess.run([sys.executable, "driver.py", str(seed), str(scale), "-1"], cwd=folder, env=env,
                                      capture_output=True, text=True, timeout=300).stdout.splitlines()[-1])["count"]
    outcomes: dict[int, Outcome] = {}
    names: dict[int, str] = {}
    start = 0
    while start < count:
        proc = subprocess.Popen([sys.executable, "driver.py", str(seed), str(scale), str(start)], cwd=folder, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        current, deadline, pids = None, time.monotonic() + 120 + limit_s, set()
        fd = proc.stdout.fileno()
        buf = b""
        ended = False
        while True:
            eof = False
            while b"\n" not in buf:
                wait = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([fd], [], [], wait)
                if not ready:
                    break
                chunk = os.read(fd, 65536)
                if not chunk:
                    eof = True
                    break
                buf += chunk
            if b"\n" not in buf and not eof:  # the case in hand ran past its bound
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                i = current if current is not None else start
                outcomes[i] = Outcome("live", names.get(i, f"case {i}"), HANG, f"still running after {limit_s:g} s")
                start = i + 1
                break
            if b"\n" not in buf:  # the driver (the caller) ended
                proc.wait()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                if ended:
                    start = count
                else:
                    i = current if current is not None else start
                    if i in outcomes:  # it ended after the case reported: the next one (a thread's exit)
                        i += 1
                    if i < count:
                        outcomes[i] = Outcome("live", names.get(i, f"case {i}"), DEATH,
                                              f"the caller's process ended with {proc.returncode}")
                    start = i + 1
                break
            raw, buf = buf.split(b"\n", 1)
            line = raw.decode("utf-8", "replace")
            try:
                msg = json.loads(line)
            except ValueError:  # the staged code's own print
                continue
            if not isinstance(msg, dict):
                continue
            if "begin" in msg:
                current = msg["begin"]
                names[current] = msg["name"]
                deadline = time.monotonic() + limit_s
            elif "end" in msg:
                i = msg["end"]
                pids.add(msg["pid"])
                verdict = msg["verdict"] if len(pids) == 1 else DEATH
                outcomes[i] = Outcome("live", names.get(i, f"case {i}"), verdict, msg["detail"])
                current = None
                deadline = time.monotonic() + limit_s
            elif "alive" in msg:
                ended = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return [outcomes[i] for i in sorted(outcomes)]


# ---- the fixture: whole pytest runs over hostile snapshot folders ----------------------------------

FIXTURE_CONFTEST = """\
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
"""


def _fixture_tests(n: int) -> str:
    lines = ["import jax", "import jax.numpy as jnp", "import pytest", "", "",
             "def step(w, x):", "    return jnp.tanh(x @ w).sum()", "", "",
             "def _args(n):", "    return jax.ShapeDtypeStruct((16, 8), jnp.float32), "
             "jax.ShapeDtypeStruct((n, 16), jnp.float32)", ""]
    for i in range(n):
        lines += ["", f"def test_{i}(stagetool_snapshot):", f"    stagetool_snapshot(step, *_args({4 + i % 3}))", ""]
    lines += ["", "@pytest.mark.parametrize('n', [pytest.param(4, id=i) for i in "
              "['a b', 'a-b', 'a/b', 'a\\\\b', 'a..b', 'A', 'a', ' ', 'é', 'a' * 300, '../x', '-', '_']])",
              "def test_ids(stagetool_snapshot, n):", "    stagetool_snapshot(step, *_args(n))", "",
              "", "def test_twice(stagetool_snapshot):", "    stagetool_snapshot(step, *_args(4))",
              "    stagetool_snapshot(step, *_args(6))", "    stagetool_snapshot(step, *_args(4))", ""]
    return "\n".join(lines)


def _run_pytest(folder: Path, *args: str, limit_s: float = 600) -> tuple[int | None, dict[str, tuple[str, str]]]:
    import xml.etree.ElementTree as ET

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", STAGETOOL_NO_CACHE="1")
    xml = folder / "junit.xml"
    with contextlib.suppress(FileNotFoundError):
        xml.unlink()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                            "stagetool.live.pytest_plugin", f"--junitxml={xml}", *args], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return None, {}
    got: dict[str, tuple[str, str]] = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            got[case.get("name") or "?"] = ("failed", (bad.get("message") or "") + (bad.text or "")) \
                if bad is not None else ("passed", "")
    return r.returncode, got


def fixture_round(work: Path, seed: int, n: int) -> list[Outcome]:
    """One test project of ``n`` tests, each with its own hostile snapshot path or content; three
    pytest runs (record with planted links and special files; compare after mutations; again)."""
    import json

    rng = random.Random(seed)
    out: list[Outcome] = []
    folder = work / "fixture"
    folder.mkdir()
    (folder / "conftest.py").write_text(FIXTURE_CONFTEST)
    (folder / "test_h.py").write_text(_fixture_tests(n))
    snaps = folder / "__stagetool__" / "test_h"
    outside = work / "outside"
    outside.mkdir()
    precious: dict[Path, bytes] = {}

    def keep(p: Path, data: bytes) -> Path:
        p.write_bytes(data)
        precious[p] = data
        return p

    # plants before the recording run: a link (to a file, a folder, a missing file), a FIFO, a folder
    snaps.mkdir(parents=True)
    planted: dict[int, str] = {}
    kinds = ["link-file", "link-missing", "link-dev-null", "fifo", "folder", "link-dir", "hardlink"]
    for i in rng.sample(range(n), min(n // 3, n)):
        kind = rng.choice(kinds)
        path = snaps / f"test_{i}.step.json"
        target = outside / f"precious_{i}.txt"
        if kind == "link-file":
            path.symlink_to(keep(target, f"precious {i}\n".encode()))
        elif kind == "link-missing":
            path.symlink_to(outside / f"missing_{i}.json")
        elif kind == "link-dev-null":
            path.symlink_to("/dev/null")
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()
        elif kind == "link-dir":
            (outside / f"dir_{i}").mkdir()
            path.symlink_to(outside / f"dir_{i}")
        else:  # a hard link is a regular file: replaced by the atomic rename, the other name kept
            os.link(keep(target, f"precious {i}\n".encode()), path)
        planted[i] = kind
    rc, got = _run_pytest(folder, "--stagetool-update")
    if rc is None:
        return [Outcome("fixture", "record run", HANG, "pytest --stagetool-update did not end")]
    for p, data in precious.items():
        if p.read_bytes() != data:
            out.append(Outcome("fixture", f"record: {p.name}", LOSS, "written through a link"))
    if any((outside / f"missing_{i}.json").exists() for i in planted):
        out.append(Outcome("fixture", "record: missing link target", LOSS, "created through a dangling link"))
    for i in range(n):
        name = f"test_{i}"
        status, text = got.get(name, ("missing", ""))
        kind = planted.get(i)
        if kind in (None, "hardlink"):
            ok = status == "passed"
        else:
            ok = status == "failed" and ("pytest --stagetool-update" in text or "remove it" in text)
        out.append(Outcome("fixture", f"record {name} ({kind or 'plain'})", OK if ok else UNEXPECTED,
                           "" if ok else f"{status}: {text[:200]}"))
    ids = sorted(k for k in got if k.startswith("test_ids"))
    for k in ids + ["test_twice"]:
        status, text = got.get(k, ("missing", ""))
        out.append(Outcome("fixture", f"record {k!r}", OK if status == "passed" else UNEXPECTED, text[:200]))

    # mutate the recorded snapshots: each must fail the next plain run
    mutated: dict[str, str] = {}
    for i in range(n):
        if i in planted:
            continue
        path = snaps / f"test_{i}.step.json"
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        kind = rng.choice(["functions-empty", "other-name", "not-json", "empty", "list", "schema", "nan",
                           "truncated", "binary", "bigger-peak", "smaller-peak", "no-functions", "deep", "keep"])
        text = None
        if kind == "functions-empty":
            doc["functions"] = {}
        elif kind == "other-name":
            doc["functions"] = {"other": doc["functions"]["step"]}
        elif kind == "not-json":
            text = "{ not json"
        elif kind == "empty":
            text = ""
        elif kind == "list":
            text = "[]"
        elif kind == "schema":
            doc["snapshot_schema"] = 999
        elif kind == "nan":
            text = path.read_text().replace('"peak_bytes": ', '"peak_bytes": NaN, "x": ', 1)
        elif kind == "truncated":
            text = path.read_text()[: len(path.read_text()) // 2]
        elif kind == "binary":
            path.write_bytes(bytes(rng.randrange(256) for _ in range(200)))
            mutated[f"test_{i}"] = kind
            continue
        elif kind in ("bigger-peak", "smaller-peak"):
            def scale(node):
                if isinstance(node, dict):
                    return {k: (int(v * (0.5 if kind == "bigger-peak" else 2)) + 1
                                if k == "peak_bytes" and isinstance(v, int) else scale(v)) for k, v in node.items()}
                if isinstance(node, list):
                    return [scale(v) for v in node]
                return node
            doc = scale(doc)
        elif kind == "no-functions":
            doc.pop("functions")
        elif kind == "deep":
            text = "[" * 100000 + "]" * 100000
        if kind == "keep":
            mutated[f"test_{i}"] = kind
            continue
        path.write_text(text if text is not None else json.dumps(doc))
        mutated[f"test_{i}"] = kind
    rc, got = _run_pytest(folder)
    if rc is None:
        return out + [Outcome("fixture", "compare run", HANG, "pytest did not end")]
    for name, kind in mutated.items():
        status, text = got.get(name, ("missing", ""))
        if kind == "keep":
            ok, verdict = status == "passed", UNEXPECTED
        elif kind == "smaller-peak":  # the recorded peak doubled: now is smaller, an improvement may pass
            ok, verdict = status in ("passed", "failed"), UNEXPECTED
        else:
            ok, verdict = status == "failed", REGRESSION
            if ok and ("Traceback" in text or len(text.strip().splitlines()) > 40):
                ok, verdict = False, UNEXPECTED
        out.append(Outcome("fixture", f"compare {name} ({kind})", OK if ok else verdict,
                           "" if ok else f"{status}: {text[:200]}"))
    for k in ids + ["test_twice"]:
        status, text = got.get(k, ("missing", ""))
        out.append(Outcome("fixture", f"compare {k!r} (unchanged)", OK if status == "passed" else UNEXPECTED,
                           text[:200]))
    if rc == 0:
        out.append(Outcome("fixture", "compare run exit status", REGRESSION, "exit 0 with failing tests"))
    return out


PROCESS_TESTS = """\
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import hostile_fns as F

X = jax.ShapeDtypeStruct((8,), jnp.float32)


def test_thread_exit_later(stagetool_snapshot):
    stagetool_snapshot(F.thread_exit_later, X)
    assert False, "fails after staging"


def test_daemon_exit_later(stagetool_snapshot):
    stagetool_snapshot(F.daemon_exit_later, X)
    assert False, "fails after staging"


def test_fork_child_sleeps(stagetool_snapshot):
    stagetool_snapshot(F.fork_child_sleeps, X)


def test_fork_child_returns(stagetool_snapshot):
    stagetool_snapshot(F.fork_child_returns, X)


def test_fork_process(stagetool_snapshot):
    stagetool_snapshot(F.fork_process, X)


def test_thread_forks_later(stagetool_snapshot):
    stagetool_snapshot(F.thread_forks_later, X)


def test_os_exit(stagetool_snapshot):
    stagetool_snapshot(F.os_exit_0, X)


def test_sys_exit(stagetool_snapshot):
    stagetool_snapshot(F.sys_exit_0, X)


def test_mesh_at_import(stagetool_snapshot):
    from hostile_mesh import MESH
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(MESH, P(None, "model")))
    stagetool_snapshot(F.two, w, jax.ShapeDtypeStruct((4, 16), jnp.float32))
"""

PROCESS_WANT = {"test_thread_exit_later": "failed", "test_daemon_exit_later": "failed",
                "test_fork_child_sleeps": "passed", "test_fork_child_returns": "passed", "test_fork_process": "passed",
                "test_thread_forks_later": "passed", "test_os_exit": "failed", "test_sys_exit": "failed",
                "test_mesh_at_import": "passed"}


def process_round(work: Path, limit_s: float) -> list[Outcome]:
    """What the staged function does to the test session, in process and isolated."""
    out: list[Outcome] = []
    for mode in ("in-process", "isolated"):
        folder = work / f"process-{mode}"
        folder.mkdir()
        (folder / "conftest.py").write_text(FIXTURE_CONFTEST)
        (folder / "hostile_fns.py").write_text(LIVE_FNS)
        (folder / "hostile_mesh.py").write_text("import jax\nfrom jax.sharding import AxisType\n"
                                                "MESH = jax.make_mesh((2, 4), ('data', 'model'), "
                                                "axis_types=(AxisType.Auto,) * 2)\n")
        (folder / "test_p.py").write_text(PROCESS_TESTS)
        start = time.monotonic()
        rc, got = _run_pytest(folder, "--stagetool-update", *(["--stagetool-isolate"] if mode == "isolated" else []),
                              limit_s=limit_s)
        if rc is None:
            out.append(Outcome("process", f"{mode} session", HANG, f"still running after {limit_s:g} s"))
            continue
        out.append(Outcome("process", f"{mode} session exit status",
                           OK if rc == 1 else (REGRESSION if rc == 0 else DEATH), f"exit {rc}"))
        for name, want in PROCESS_WANT.items():
            status, text = got.get(name, ("missing", ""))
            verdict = OK if status == want else (REGRESSION if status == "passed" else UNEXPECTED)
            out.append(Outcome("process", f"{mode} {name}", verdict, "" if verdict == OK else f"{status}: {text[:200]}"))
        out.append(Outcome("process", f"{mode} time", OK if time.monotonic() - start < limit_s / 2 else HANG,
                           f"{time.monotonic() - start:.0f} s"))
    return out


# ---- chip constants ---------------------------------------------------------------------------------


def chip_cases(rng: random.Random, n: int) -> list[tuple[str, Callable[[], str]]]:
    from stagetool.core import chips as C
    from stagetool.core.errors import SpecError

    ints = sorted(C._INT_FIELDS)
    floats = [f for f in C._FIGURES if f not in C._INT_FIELDS]
    bad = [0, -1, 0.5, 1.5, 0.999, -0.5, float("nan"), float("inf"), -float("inf"), "0.5", "x", True, None, [], {},
           "1e-400", 1e-300 if False else 0.0]
    out = []

    def one(chip_name: str, entry: dict, must_refuse: bool) -> Callable[[], str]:
        def run() -> str:
            try:
                table = C.merge_chips({chip_name: entry})
            except SpecError:
                return OK if must_refuse else f"{UNEXPECTED}\trefused {entry!r}"
            except Exception as e:  # noqa: BLE001
                return f"{UNEXPECTED}\t{type(e).__name__}: {e}"
            if must_refuse:
                return f"{PASS}\taccepted {entry!r}"
            chip = table[chip_name]
            for f in ints:
                v = getattr(chip, f, None)
                if v is not None and (not isinstance(v, int) or v < 1):
                    return f"{UNEXPECTED}\t{f} became {v!r}"
            return OK
        return run

    for i in range(n):
        rng_name = rng.choice(["tpu-v5e", "tpu-v4", "h100-sxm"])
        field = rng.choice(ints + floats)
        value = rng.choice(bad)
        if value is None:
            continue
        must = not (field in floats and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0) and not (field in floats and value == "0.5")
        if field in ints and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value >= 1 and value == int(value):
            must = False
        out.append((f"{rng_name}.{field}={value!r}", one(rng_name, {field: value}, must)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the number of in-process runs")
    ap.add_argument("--jobs", type=int, default=2, help="whole command runs at a time")
    ap.add_argument("--no-cli", action="store_true", help="leave out the whole command runs")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every bad run")
    ap.add_argument("--round", type=int, default=3, choices=(3, 4),
                    help="3: the families above; 4: issue 42's (the pytest fixture, inspect/LiveReport, isolation, "
                         "chip constants)")
    ap.add_argument("--limit", type=float, default=90.0, help="round 4: seconds one case may take")
    ap.add_argument("--only", default="chips,live,fixture,process", help="round 4: the families to run")
    args = ap.parse_args()
    if args.round == 4:
        return round4(args)
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



def round4(args: argparse.Namespace) -> int:
    """Issue 42's round: prints runs per family and verdict; exit 1 on any data loss, passed
    regression, hang or caller death (unexpected errors are listed, and count too)."""
    rng = random.Random(args.seed)
    start = time.monotonic()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-hostile4-") as tmp:
        work = Path(tmp)
        only = set(args.only.split(","))
        if "chips" in only:
            for name, fn in chip_cases(rng, max(1, int(60 * args.scale))):
                verdict, detail = in_child(fn, 10.0)
                outcomes.append(Outcome("chips", name, verdict, detail))
        if "live" in only:
            outcomes += live_round(work, args.seed, args.scale, args.limit)
        if "fixture" in only:
            outcomes += fixture_round(work, args.seed, max(6, int(45 * args.scale)))
        if "process" in only:
            outcomes += process_round(work, max(300.0, args.limit * 4))
    seconds = time.monotonic() - start
    verdicts = (OK, LOSS, REGRESSION, PASS, HANG, DEATH, UNEXPECTED)
    table = collections.defaultdict(collections.Counter)
    for o in outcomes:
        table[o.family][o.verdict] += 1
    print(f"{'family':<10} {'runs':>5} " + " ".join(f"{v:>18}" for v in verdicts))
    for family, counts in [*table.items(), ("all", collections.Counter(o.verdict for o in outcomes))]:
        print(f"{family:<10} {sum(counts.values()):>5} " + " ".join(f"{counts[v]:>18}" for v in verdicts))
    print(f"({seconds:.0f} s, seed {args.seed}, scale {args.scale})")
    bad = [o for o in outcomes if o.verdict != OK]
    for o in bad if args.verbose or len(bad) <= 40 else bad[:40]:
        print(f"  {o.verdict}: {o.family} {o.name}: {o.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
