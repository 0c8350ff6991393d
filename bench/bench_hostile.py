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
    ap.add_argument("--round", type=int, default=3, choices=(3, 4, 5),
                    help="3: the families above; 4: issue 42's (the pytest fixture, inspect/LiveReport, isolation, "
                         "chip constants); 5: issue 47's (two estimates compared, a changed chip profile, --measure, "
                         "fit, calibrate, atexit, huge numbers)")
    ap.add_argument("--limit", type=float, default=90.0, help="round 4: seconds one case may take")
    ap.add_argument("--only", default="chips,live,fixture,process",
                    help="round 4: the families to run; round 5: of " + ",".join(R5_FAMILIES) + " (default all)")
    args = ap.parse_args()
    if args.round == 4:
        return round4(args)
    if args.round == 5:
        return round5(args)
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



# ==== round 5 (issue 47): what round 4 never reached =====================================================
#
# Families: ``gate`` (two step-time estimates compared: a faster, a slower and an equal step through
# snapshot/check/diff and the fixture), ``profile`` (the chip profile changed between snapshot and
# check), ``measure`` (``--measure`` on the attached CPU devices: a callback that raises, host memory
# running out, its options), ``fit``, ``calibrate`` (``--cpu-for-tests``: names and ``-o`` the loader
# would refuse, a profile read back by the loader), ``atexit`` (handlers a staged function registers,
# in a caller process that must keep its own exit status), ``huge`` (chip figures and options of no
# chip or run: huge integers, 1e-308, NaN text, one chip named in two cases, a profile of another
# chip). Verdicts: ok, data loss, passed regression, hang, caller death, unexpected (a raw exception,
# "unexpected ... report it", a lower bound read as a full figure, a changed profile blamed on the code).

R5_MODEL = """\
import atexit
import os
import threading
import time

import jax
import jax.numpy as jnp

V = os.environ.get("VARIANT", "base")


def step(w, x):
    if V == "highest":  # the same FLOPs and bytes, a slower matmul class on a TPU
        y = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
    elif V == "bigger":  # twice the rows
        y = jnp.concatenate([x, x], 0) @ w
    elif V == "sort":  # a sort after the matmul: work no model covers (a lower bound)
        y = jnp.sort(x @ w, axis=0)
    else:
        y = x @ w
    return jnp.tanh(y).sum()


def stepb(w, x):
    return jnp.tanh(x @ w).sum()


def bad_cb(x):
    raise ValueError("the user's callback failed")


def callback(w, x):
    y = jax.pure_callback(bad_cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return (y @ w).sum()


def huge(w, x):
    return jnp.broadcast_to(x, (1 << 24, x.shape[-1])) * 2


def batched(w, x):
    return jnp.sort(jnp.tanh(x @ w), axis=0).sum()
"""

R5_ATEXIT = """\
import atexit
import os
import sys
import threading
import time
from atexit import register as bound_register

import jax.numpy as jnp


def exit0(x):
    atexit.register(os._exit, 0)
    return x * 2


def exit7(x):
    atexit.register(os._exit, 7)
    return x * 2


def decorated(x):
    @atexit.register
    def bye():
        os._exit(0)
    return x * 2


def sys_exit_handler(x):
    atexit.register(sys.exit, 0)
    return x * 2


def from_thread(x):
    def later():
        time.sleep(0.3)
        atexit.register(os._exit, 0)
    threading.Thread(target=later).start()
    return x * 2


def imports_module(x):
    import r5_registers_at_import  # noqa: F401 - registers os._exit(0) when imported
    return x * 2


def unregisters(x):
    import r5_caller_handler
    atexit.unregister(r5_caller_handler.mine)
    return x * 2


def bound(x):
    bound_register(print, "stagetool: a handler bound before the staging ran")
    return x * 2
"""

R5_ATEXIT_CALLER = """\
import atexit
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp

import r5_caller_handler
import r5_atexit_fns as F
import stagetool

if __name__ == "__main__":  # (an isolated run's worker is spawned: it imports this file)
    atexit.register(r5_caller_handler.mine)
    fn = getattr(F, sys.argv[1])
    try:
        stagetool.inspect(fn, jax.ShapeDtypeStruct((8,), jnp.float32), isolate=sys.argv[2] == "isolated")
    except stagetool.StagingError as e:
        print("staging error:", e, flush=True)
    import time
    time.sleep(0.5)  # a thread the function started gets its turn
    sys.exit(5)
"""

R5_PYTEST = """\
import jax
import jax.numpy as jnp
import pytest

import r5_model as M
import r5_atexit_fns as A

W = jax.ShapeDtypeStruct((512, 512), jnp.float32)
X = jax.ShapeDtypeStruct((256, 512), jnp.float32)


def test_step(stagetool_snapshot):
    stagetool_snapshot(M.step, W, X, chip="tpu-v5e")


def test_atexit_then_fails(stagetool_snapshot):
    if not __import__("os").environ.get("R5_ATEXIT"):
        pytest.skip("the atexit run only")
    stagetool_snapshot(A.exit0, jax.ShapeDtypeStruct((8,), jnp.float32))
    assert False, "fails after staging"
"""


def _r5_env(work: Path, **extra: str) -> dict:
    env = _env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(work)])
    env.update(extra)
    return env


def _r5_run(work: Path, args: list[str], *, env: dict | None = None, limit_s: float = 180.0, shell: str = "",
            python: bool = False) -> tuple[int | None, str, str]:
    """One process in ``work``: ``python -m stagetool ARGS`` (or ``python ARGS`` with ``python``);
    (exit code or None on a hang, stdout, stderr)."""
    argv = [sys.executable, *([] if python else ["-m", "stagetool"]), *args]
    if shell:
        argv = ["sh", "-c", f'{shell} && exec "$@"', "sh", *argv]
    try:
        r = subprocess.run(argv, cwd=work, env=env or _r5_env(work), capture_output=True, text=True,
                           timeout=limit_s)
    except subprocess.TimeoutExpired:
        return None, "", ""
    return r.returncode, r.stdout, r.stderr


def _r5_judge(family: str, name: str, got: tuple[int | None, str, str], codes: tuple[int, ...], *,
              stderr_has: str = "", stdout_has: str = "", limit_s: float = 180.0, lower_bound_check: bool = False,
              regression_if_zero: bool = False, known_lower_bound: bool = False) -> Outcome:
    rc, out, err = got
    if rc is None:
        return Outcome(family, name, HANG, f"still running after {limit_s:g} s")
    said = [ln for ln in err.splitlines() if ln.startswith("error:")]  # stagetool's own last word
    if "error: unexpected" in err or ("Traceback (most recent call last)" in err and not said):
        last = [ln for ln in err.strip().splitlines() if "unexpected" in ln or "Error" in ln][-1:] or [err[-200:]]
        return Outcome(family, name, UNEXPECTED, last[0][:240])
    if rc not in codes:
        verdict = REGRESSION if (rc == 0 and regression_if_zero) else UNEXPECTED
        tail = " | ".join((err.strip().splitlines() or [""])[-2:])[:240]
        return Outcome(family, name, verdict, f"exit {rc}, wanted {codes}: {tail}")
    if stderr_has and stderr_has not in err:
        return Outcome(family, name, UNEXPECTED, f"stderr lacks {stderr_has!r}: {err.strip()[-200:]!r}")
    if stdout_has and stdout_has.lower() not in out.lower():
        return Outcome(family, name, UNEXPECTED, f"stdout lacks {stdout_has!r}")
    if lower_bound_check:
        bad = _lower_bound_read_as_full(out, known_lower_bound)
        if bad:
            return Outcome(family, name, UNEXPECTED, f"a lower bound read as a full figure: {bad}")
    return Outcome(family, name, OK)


def _lower_bound_read_as_full(text: str, known: bool = False) -> str | None:
    """Where a step time that is a lower bound (the report says so, or ``known``: a sort no model
    covers) is shown without "at least" / "≥": the ``--measure`` table's estimated step, ``check``'s
    step-time row, a fit row."""
    if not known and "lower bound" not in text and "at least" not in text:
        return None
    for line in text.splitlines():
        low = line.lower()
        if ("step (wall clock)" in low or "step time (estimate" in low) and not (
                "at least" in low or "≥" in line or ">=" in line or "lower bound" in low):
            return line.strip()[:160]
    return None


def r5_setup(work: Path) -> None:
    (work / "tmp").mkdir(exist_ok=True)
    (work / "r5_model.py").write_text(R5_MODEL)
    (work / "r5_atexit_fns.py").write_text(R5_ATEXIT)
    (work / "r5_caller.py").write_text(R5_ATEXIT_CALLER)
    (work / "r5_registers_at_import.py").write_text("import atexit, os\natexit.register(os._exit, 0)\n")
    (work / "r5_caller_handler.py").write_text(
        "import sys\n\n\ndef mine():\n    sys.stdout.write('caller handler ran\\n')\n    sys.stdout.flush()\n")
    (work / "s.yaml").write_text("functions:\n  step: {target: r5_model.py:step, args: ['f32[512,512]', "
                                 "'f32[256,512]']}\n")
    (work / "cb.yaml").write_text("functions:\n  callback: {target: r5_model.py:callback, args: ['f32[8,8]', "
                                  "'f32[4,8]']}\n")
    (work / "huge.yaml").write_text("functions:\n  huge: {target: r5_model.py:huge, args: ['f32[8,8]', "
                                    "'f32[1024]']}\n")
    (work / "fit.yaml").write_text("functions:\n  batched: {target: r5_model.py:batched, args: ['f32[256,256]', "
                                   "'f32[${batch},256]']}\n")


def _chips_yaml(scale: float = 1.0, highest: float | None = None) -> str:
    """The bundled tpu-v5e profile's measured rates, each × ``scale`` (a recalibration; < 1 slower),
    with ``f32_highest`` at ``highest`` when given (a forged class)."""
    from stagetool.core.chips import CHIPS

    c = CHIPS["tpu-v5e"]
    mm = {k: v * scale for k, v in c.matmul_flops_per_second}
    if highest is not None:
        mm["f32_highest"] = highest
    rates = ", ".join(f"{k}: {v:.6e}" for k, v in mm.items())
    fields = ["hbm_copy_bytes_per_second", "elementwise_bytes_per_second", "reduction_bytes_per_second",
              "transcendentals_per_second", "gather_bytes_per_second", "scatter_bytes_per_second"]
    fields += ["peak_flops_per_second_bf16", "hbm_bandwidth_bytes_per_second"]  # a faster chip's peaks too
    rest = ", ".join(f"{f}: {getattr(c, f) * scale:.6e}" for f in fields)
    return f"chips:\n  tpu-v5e: {{matmul_flops_per_second: {{{rates}}}, {rest}}}\n"


def r5_gate(work: Path, jobs: int) -> list[Outcome]:
    """Two estimates compared: snapshots of four variants under --chip tpu-v5e; check (live) and diff
    (two files) of each pair whose order is known by construction (a variant is base plus work)."""
    out: list[Outcome] = []
    variants = ["base", "highest", "bigger", "sort"]
    snaps = {}
    for v in variants:
        got = _r5_run(work, ["snapshot", "--spec", "s.yaml", "--chip", "tpu-v5e", "-o", f"snap-{v}.json"],
                      env=_r5_env(work, VARIANT=v))
        o = _r5_judge("gate", f"snapshot {v}", got, (0,))
        out.append(o)
        snaps[v] = o.verdict == OK
    pairs = [(a, b, want) for a, b, want in
             [("base", v, "slower") for v in variants[1:]] + [(v, "base", "faster") for v in variants[1:]]
             + [(v, v, "equal") for v in variants]]
    cases = []
    for a, b, want in pairs:
        if not snaps[a]:
            continue
        codes = (1,) if want == "slower" else (0,)
        cases.append((f"check {a} -> {b} ({want})", ["check", "--spec", "s.yaml", "--chip", "tpu-v5e", "-b",
                                                       f"snap-{a}.json"], _r5_env(work, VARIANT=b), codes, want))
        if snaps[b]:
            cases.append((f"diff {a} -> {b} ({want})", ["diff", f"snap-{a}.json", f"snap-{b}.json",
                                                          "--fail-on-regression"], None, codes, want))
            if want == "faster":
                cases.append((f"diff {a} -> {b} ({want}) json", ["diff", f"snap-{a}.json", f"snap-{b}.json",
                                                                   "--format", "json"], None, (0,), want))

    def one(case):
        name, args, env, codes, want = case
        got = _r5_run(work, args, env=env)
        o = _r5_judge("gate", name, got, codes, regression_if_zero=want == "slower",
                      lower_bound_check="sort" in name and "json" not in name, known_lower_bound="-> sort" in name)
        if o.verdict == OK and args[-1] == "json":
            import json
            try:
                json.loads(got[1])
            except ValueError as e:
                return Outcome("gate", name, UNEXPECTED, f"not JSON: {e}")
        return o

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        out += list(pool.map(one, cases))
    # the fixture: recorded on the HIGHEST step; the default (faster) step passes, the sort (slower) fails
    proj = work / "fixture5"
    proj.mkdir()
    for f in ("r5_model.py", "r5_atexit_fns.py"):
        shutil.copy(work / f, proj / f)
    (proj / "conftest.py").write_text(FIXTURE_CONFTEST)
    (proj / "test_r5.py").write_text(R5_PYTEST)
    old = os.environ.get("VARIANT")
    try:
        for variant, args, want in (("highest", ("--stagetool-update",), "passed"), ("base", (), "passed"),
                                    ("sort", (), "failed"), ("highest", (), "passed")):
            os.environ["VARIANT"] = variant
            rc, got = _run_pytest(proj, *args, "-k", "test_step", limit_s=300)
            name = f"fixture {variant}{' (record)' if args else ''}"
            if rc is None:
                out.append(Outcome("gate", name, HANG, "pytest did not end"))
                continue
            status, text = got.get("test_step", ("missing", ""))
            if status == want:
                bad = "Traceback" in text or "unexpected" in text
                out.append(Outcome("gate", name, UNEXPECTED if bad else OK, text[:200] if bad else ""))
            else:
                out.append(Outcome("gate", name, REGRESSION if status == "passed" else UNEXPECTED,
                                   f"{status}, wanted {want}: {text[:200]}"))
    finally:
        if old is None:
            os.environ.pop("VARIANT", None)
        else:
            os.environ["VARIANT"] = old
    return out


def r5_profile(work: Path, jobs: int) -> list[Outcome]:
    """The chip's figures changed between snapshot and check: a recalibration with the code unchanged
    must be filed as the profile's, never the code's; a forged profile must not hide a regression the
    code made (the HIGHEST matmul, 6× slower on the v5e, with its class forged to DEFAULT's rate)."""
    from stagetool.core.chips import CHIPS

    (work / "p_base.yaml").write_text((work / "s.yaml").read_text() + _chips_yaml())
    (work / "p_slow.yaml").write_text((work / "s.yaml").read_text() + _chips_yaml(scale=0.5))
    f32 = dict(CHIPS["tpu-v5e"].matmul_flops_per_second)["f32"]
    (work / "p_forged.yaml").write_text((work / "s.yaml").read_text() + _chips_yaml(highest=f32))
    out = [_r5_judge("profile", "snapshot", _r5_run(work, ["snapshot", "--spec", "p_base.yaml", "--chip", "tpu-v5e",
                                                          "-o", "p.json"], env=_r5_env(work, VARIANT="base")), (0,))]
    if out[0].verdict != OK:
        return out
    cases = [
        ("unchanged code, unchanged profile", "p_base.yaml", "base", (0,), ""),
        ("unchanged code, profile recalibrated 2x slower", "p_slow.yaml", "base", (0, 1), "profile"),
        ("HIGHEST matmul, its class forged to DEFAULT's rate", "p_forged.yaml", "highest", (1,), ""),
        ("HIGHEST matmul, unchanged profile", "p_base.yaml", "highest", (1,), ""),
        ("twice the rows, profile 2x faster", None, "bigger", (1,), ""),
    ]
    (work / "p_fast.yaml").write_text((work / "s.yaml").read_text() + _chips_yaml(scale=2.0))

    def one(case):
        name, spec, variant, codes, says = case
        got = _r5_run(work, ["check", "--spec", spec or "p_fast.yaml", "--chip", "tpu-v5e", "-b", "p.json"],
                      env=_r5_env(work, VARIANT=variant))
        o = _r5_judge("profile", name, got, codes, regression_if_zero=codes == (1,))
        if o.verdict == OK and says and "profile changed" not in got[1].lower():
            return Outcome("profile", name, UNEXPECTED, "the changed chip profile is not named (filed as the code's)")
        return o

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        out += list(pool.map(one, cases))
    return out


def r5_measure(work: Path, jobs: int) -> list[Outcome]:
    """``--measure`` on the attached CPU devices."""
    limit_kib = 6 * 2**20
    cases = [
        ("measure", ["cost", "--spec", "s.yaml", "--chip", "tpu-v5e", "--measure", "--measure-steps", "2"], {},
         (0,), "", "measured vs estimated", ""),
        ("measure a lower bound (sort)", ["cost", "--spec", "s.yaml", "--chip", "tpu-v5e", "--measure",
                                          "--measure-steps", "2"], {"VARIANT": "sort"}, (0,), "", "measured", ""),
        ("report --measure json", ["report", "--spec", "s.yaml", "--measure", "--measure-steps", "1", "--format",
                                   "json"], {}, (0,), "", "", ""),
        ("a host callback that raises", ["cost", "--spec", "cb.yaml", "--measure", "--measure-steps", "1"], {},
         (3,), "host callback raised", "", ""),
        ("host memory runs out", ["cost", "--spec", "huge.yaml", "--measure", "--measure-steps", "1"], {}, (2,),
         "ran out of memory", "", f"ulimit -v {limit_kib}"),
        ("--measure-steps without --measure", ["cost", "--spec", "s.yaml", "--measure-steps", "3"], {}, (2,),
         "--measure-steps", "", ""),
        ("--measure-steps 0", ["cost", "--spec", "s.yaml", "--measure", "--measure-steps", "0"], {}, (2,), "", "", ""),
        ("--measure on a compile-only topology", ["cost", "--spec", "s.yaml", "--measure", "--topology", "v5e:1x1"],
         {}, (2,), "", "", ""),
    ]

    def one(case):
        name, args, extra, codes, err_has, out_has, shell = case
        got = _r5_run(work, args, env=_r5_env(work, **extra), shell=shell)
        o = _r5_judge("measure", name, got, codes, stderr_has=err_has, stdout_has=out_has,
                      lower_bound_check="sort" in name, known_lower_bound="sort" in name)
        if o.verdict == OK and "json" in name:
            import json
            try:
                json.loads(got[1])
            except ValueError as e:
                return Outcome("measure", name, UNEXPECTED, f"not JSON: {e}")
        return o

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


def r5_fit(work: Path, jobs: int) -> list[Outcome]:
    """``fit`` over a batch whose step has a sort (its step time is a lower bound), and bad numbers."""
    base = ["fit", "--spec", "fit.yaml", "--device-memory", "512KiB", "--chip", "tpu-v5e", "--multiple", "8",
            "--start", "8", "--max-compiles", "12", "-j", "2"]
    cases = [
        ("fit text", base + ["--max-batch", "256"], (0,), ""),
        ("fit json", base + ["--max-batch", "256", "--format", "json"], (0,), ""),
        ("--max-batch huge", base + ["--max-batch", "9" * 40], (0, 2), ""),
        ("--device-memory 1e400GB", ["fit", "--spec", "fit.yaml", "--device-memory", "1e400GB"], (2,), ""),
        ("--device-memory 0", ["fit", "--spec", "fit.yaml", "--device-memory", "0"], (2,), ""),
        ("--tokens-per-example huge", base + ["--max-batch", "64", "--tokens-per-example", "9" * 40], (0, 2), ""),
    ]

    def one(case):
        name, args, codes, _ = case
        got = _r5_run(work, args, limit_s=300)
        o = _r5_judge("fit", name, got, codes, limit_s=300, lower_bound_check=True)
        if o.verdict == OK and name == "fit json":
            import json
            try:
                doc = json.loads(got[1])
            except ValueError as e:
                return Outcome("fit", name, UNEXPECTED, f"not JSON: {e}")
            text = json.dumps(doc)
            if '"step_time"' in text and "lower_bound" not in text:
                return Outcome("fit", name, UNEXPECTED, "a step time that is a lower bound (a sort) carries no "
                                                        "lower_bound in fit's JSON")
        if o.verdict == OK and name == "fit text" and "at least" not in got[1] and "≥" not in got[1]:
            return Outcome("fit", name, UNEXPECTED, "the step time (a lower bound: a sort) is shown without 'at least'")
        return o

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


def r5_calibrate(work: Path, jobs: int) -> list[Outcome]:
    """``calibrate --cpu-for-tests``: what the loader would refuse is refused before any benchmark; what
    it writes, the loader reads back (and ``--chip NAME`` stages with it)."""
    quick = ["calibrate", "--cpu-for-tests", "--repeats", "3", "--warmup", "1"]
    (work / "folder.yaml").mkdir()
    cases: list = []
    for bad in ("a#b", "a: b", "", " ", "x" * 65, "-x", "tpu v5e", "é", "a\nb"):
        cases.append((f"--name {bad!r}", quick + ["--name", bad], (2,), "--name", None))
    for bad in ("/nonexistent-folder/p.yaml", "folder.yaml", "/proc/self/nope/p.yaml"):
        cases.append((f"-o {bad}", quick + ["--name", "npu", "-o", bad], (2,), "--output", None))
    cases.append(("JAX_PLATFORMS=tpu", ["calibrate"], (2,), "JAX could not start", {"JAX_PLATFORMS": "tpu"}))
    cases.append(("--repeats huge", quick + ["--repeats", "9" * 40], (2,), "", None))
    for name in ("npu-cpu", "tpu-v5e"):
        cases.append((f"write {name} and load it", quick + ["--name", name, "-o", f"prof-{name}.yaml"], (0,), "",
                      None))

    def one(case):
        name, args, codes, err_has, extra = case
        got = _r5_run(work, args, env=_r5_env(work, **(extra or {})), limit_s=240)
        o = _r5_judge("calibrate", name, got, codes, stderr_has=err_has, limit_s=240)
        if o.verdict == OK and codes != (0,) and ("calibrating" in got[2] or "matmul_bf16" in got[2]):
            return Outcome("calibrate", name, UNEXPECTED, "refused only after benchmarks ran")
        if o.verdict != OK or codes != (0,):
            return o
        chip = args[args.index("--name") + 1]
        prof = work / f"prof-{chip}.yaml"
        spec = work / f"with-{chip}.yaml"
        try:
            text = prof.read_text()
        except OSError as e:
            return Outcome("calibrate", name, UNEXPECTED, f"no profile written: {e}")
        spec.write_text((work / "s.yaml").read_text() + text)
        got = _r5_run(work, ["cost", "--spec", spec.name, "--chip", chip])
        return _r5_judge("calibrate", name + " (cost --chip)", got, (0,), stdout_has="step time")

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


def r5_atexit(work: Path, jobs: int) -> list[Outcome]:
    """A caller that stages a function registering atexit handlers, then exits 5: it must exit 5 (and
    its own handler run); a pytest session with a failing test must exit 1."""
    fns = ["exit0", "exit7", "decorated", "sys_exit_handler", "from_thread", "imports_module", "unregisters",
           "bound"]
    cases = [(f, mode) for f in fns for mode in ("in-process", "isolated")]

    def one(case):
        fn, mode = case
        name = f"{fn} {mode}"
        rc, out_text, err = _r5_run(work, ["r5_caller.py", fn, mode], python=True, limit_s=180)
        if rc is None:
            return Outcome("atexit", name, HANG, "still running after 180 s")
        if "error: unexpected" in err:
            return Outcome("atexit", name, UNEXPECTED, err.strip().splitlines()[-1][:200])
        if rc != 5:
            return Outcome("atexit", name, DEATH, f"the caller's exit status became {rc} (it exits 5)")
        if "caller handler ran" not in out_text:
            return Outcome("atexit", name, UNEXPECTED, "the caller's own atexit handler did not run")
        return Outcome("atexit", name, OK)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        out = list(pool.map(one, cases))
    proj = work / "fixture5"
    if not proj.exists():
        proj.mkdir()
        for f in ("r5_model.py", "r5_atexit_fns.py"):
            shutil.copy(work / f, proj / f)
        (proj / "conftest.py").write_text(FIXTURE_CONFTEST)
        (proj / "test_r5.py").write_text(R5_PYTEST)
    os.environ["R5_ATEXIT"] = "1"
    try:
        for mode in ((), ("--stagetool-isolate",)):
            name = f"pytest session {'isolated' if mode else 'in-process'}"
            rc, got = _run_pytest(proj, "--stagetool-update", "-k", "test_atexit_then_fails", *mode, limit_s=300)
            if rc is None:
                out.append(Outcome("atexit", name, HANG, "pytest did not end"))
            else:
                out.append(Outcome("atexit", name, OK if rc == 1 else (REGRESSION if rc == 0 else DEATH),
                                   f"exit {rc} with a failing test"))
    finally:
        os.environ.pop("R5_ATEXIT", None)
    return out


def r5_huge_cases(rng: random.Random, n: int) -> list[tuple[str, Callable[[], str]]]:
    """Chip figures through the spec's ``chips:`` loader: numbers no chip has, names twice, a profile of
    another chip. Accepted figures must be finite and give a finite, positive time to a unit of work."""
    from stagetool.core import chips as C

    fields = list(C._FIGURES)
    values: list = [10**400, -(10**400), 2**64, 2**63 - 1, 1e-308, 5e-324, 1e308, 1e21, 1e22, 1.0, 0.999, "1e400",
                    "-1e400", "nan", "NaN", "inf", "9" * 5000, "1e-308", "0x10", 10**25, 1e-13, 61.0]
    out = []

    def one(entry: dict, text_twice: bool = False) -> Callable[[], str]:
        def run() -> str:
            from pathlib import Path as _P

            import yaml

            from stagetool.core.errors import SpecError
            from stagetool.spec.parse import parse_spec

            body = yaml.safe_dump({"chips": entry}, allow_unicode=True, width=10**6)
            try:
                spec = parse_spec("functions: {f: m.py:f}\n" + body, file="h.yaml", base_dir=_P("/x"))
                table = C.merge_chips(spec.chips)
            except SpecError as e:
                if not all(i.startswith("h.yaml:") for i in e.issues):
                    return f"{UNEXPECTED}\ta problem without its file:line: {e.issues[0][:120]}"
                return OK
            except Exception as e:  # noqa: BLE001
                return f"{UNEXPECTED}\t{type(e).__name__}: {str(e)[:160]}"
            if text_twice:
                return f"{PASS}\tone chip named twice in two cases accepted"
            for chip in table.values():
                for f in fields:
                    v = getattr(chip, f)
                    if v is None:
                        continue
                    if not math.isfinite(float(v)) or v <= 0:
                        return f"{PASS}\t{chip.name}.{f} = {v!r} accepted"
                    t = (1.0 / v) if not f.endswith("seconds") else v
                    if not math.isfinite(t) or t <= 0 or t > 1e6:
                        return f"{PASS}\t{chip.name}.{f} = {v!r}: a time of {t!r} s per unit of work"
                for cls, r in chip.matmul_flops_per_second:
                    if not math.isfinite(r) or not 1 <= r <= 1e21:
                        return f"{PASS}\t{chip.name}.matmul {cls} = {r!r} accepted"
                    peak = chip.peak_flops_per_second_bf16
                    if peak and cls in ("bf16", "f32", "f32_highest") and r > peak * 1.05:
                        return f"{PASS}\t{chip.name}.matmul {cls} {r:.3g} above its peak {peak:.3g} (MFU over 100%)"
                measured_on = dict(chip.profile).get("measured_on")
                other = C.chip_for_device_kind(measured_on) if measured_on else None
                if other and other != chip.name and chip.name in C.CHIPS:
                    return f"{PASS}\ta profile measured on {measured_on} accepted under {chip.name}"
            return OK
        return run

    for _ in range(n):
        chip = rng.choice(["tpu-v5e", "h100-sxm", "npu"])
        field = rng.choice(fields + ["matmul_flops_per_second"])
        value = rng.choice(values)
        if field == "matmul_flops_per_second":
            entry = {chip: {field: {rng.choice(["bf16", "f32", "f32_highest", "int8"]): value}}}
        else:
            entry = {chip: {field: value}}
        if chip == "npu":
            entry["npu"].setdefault("hbm_bandwidth_bytes_per_second", 1e12)
        out.append((f"{chip}.{field}={str(value)[:24]}", one(entry)))
    for a, b in (("TPU-V5E", "tpu-v5e"), ("Tpu-V5e", "TPU-v5E"), ("npu", "NPU ")):
        out.append((f"{a!r} beside {b!r}", one({a: {"clock_hz": 1e9}, b: {"clock_hz": 2e9}}, text_twice=True)))
    for kind, name in (("NVIDIA H100 80GB HBM3", "tpu-v5e"), ("TPU v5 lite", "h100-sxm"), ("TPU v4", "tpu-v5e")):
        out.append((f"profile of {kind} under {name}", one({name: {"profile": {"measured_on": kind},
                                                                   "clock_hz": 1e9}})))
    out.append(("H100 rates under tpu-v5e", one({"tpu-v5e": {"matmul_flops_per_second": {"bf16": 7.5e14}}})))
    return out


def r5_huge_cli(work: Path, jobs: int) -> list[Outcome]:
    big = "9" * 40
    (work / "hugechip.yaml").write_text((work / "s.yaml").read_text()
                                        + f"chips:\n  tpu-v5e: {{hbm_bandwidth_bytes_per_second: {'1' + '0' * 400}}}\n")
    (work / "tinyrate.yaml").write_text((work / "s.yaml").read_text()
                                        + "chips:\n  tpu-v5e: {elementwise_bytes_per_second: 1.0e-308}\n")
    (work / "newchip.yaml").write_text((work / "s.yaml").read_text()
                                       + "chips:\n  npu: {peak_flops_per_second_bf16: 1.0e+14}\n")
    cases = [
        ("a 400-digit chip figure", ["cost", "--spec", "hugechip.yaml", "--chip", "tpu-v5e"], (2,), "hugechip.yaml:"),
        ("a rate of 1e-308", ["cost", "--spec", "tinyrate.yaml", "--chip", "tpu-v5e"], (2,), "tinyrate.yaml:"),
        ("a new chip without HBM bandwidth", ["cost", "--spec", "newchip.yaml", "--chip", "npu"], (0,), ""),
        ("--measure-steps huge", ["cost", "--spec", "s.yaml", "--measure", "--measure-steps", big], (2,), ""),
        ("--device-memory huge", ["memory", "--spec", "s.yaml", "--device-memory", big + "GiB"], (0, 2), ""),
        ("--timeout 1e400", ["check", "--spec", "s.yaml", "-b", "x.json", "--timeout", "1e400"], (2,), ""),
        ("--tolerance huge", ["diff", "a.json", "b.json", "--tolerance", "peak=" + big], (2,), ""),
        ("--jobs huge", ["snapshot", "--spec", "s.yaml", "-o", "j.json", "--jobs", big], (0, 2), ""),  # capped by the functions
    ]

    def one(case):
        name, args, codes, err_has = case
        got = _r5_run(work, args)
        o = _r5_judge("huge", name, got, codes, stderr_has=err_has)
        if o.verdict == OK and name == "a new chip without HBM bandwidth" and "left out" not in got[1]:
            return Outcome("huge", name, UNEXPECTED, "the memory part is dropped without a reason")
        return o

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


R5_FAMILIES = ("gate", "profile", "measure", "fit", "calibrate", "atexit", "huge")


def round5(args: argparse.Namespace) -> int:
    """Issue 47's round: runs per family and verdict; exit 1 on any bad run."""
    rng = random.Random(args.seed)
    start = time.monotonic()
    outcomes: list[Outcome] = []
    only = set(args.only.split(",")) if args.only != "chips,live,fixture,process" else set(R5_FAMILIES)
    jobs = max(1, args.jobs)
    with tempfile.TemporaryDirectory(prefix="bench-hostile5-") as tmp:
        work = Path(tmp)
        r5_setup(work)
        if "huge" in only:
            for name, fn in r5_huge_cases(rng, max(1, int(80 * args.scale))):
                verdict, detail = in_child(fn, 20.0)
                outcomes.append(Outcome("huge", name, verdict, detail))
        steps = [("gate", r5_gate), ("profile", r5_profile), ("measure", r5_measure), ("fit", r5_fit),
                 ("calibrate", r5_calibrate), ("atexit", r5_atexit), ("huge", r5_huge_cli)]
        for family, fn in steps:
            if family in only:
                t0 = time.monotonic()
                outcomes += fn(work, jobs)
                if args.verbose:
                    print(f"  ({family}: {time.monotonic() - t0:.0f} s)", flush=True)
        left = [p.name for p in (work / "tmp").iterdir()]
        if left:
            outcomes.append(Outcome("huge", "temporaries", UNEXPECTED, f"left in TMPDIR: {left[:3]}"))
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
    for o in bad if args.verbose or len(bad) <= 60 else bad[:60]:
        print(f"  {o.verdict}: {o.family} {o.name}: {o.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
