"""Ask Linux for AMX tile state in every process of vLLM's CPU engine (issue 42).

Linux hands a process the AMX tile data state (XTILEDATA) only after it asks, with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; an AMX instruction run before that kills
the process with SIGILL (exit -4). torch asks inside its own oneDNN paths only
(``torch._C._cpu._init_amx``), while vLLM's CPU attention picks its ``amx`` kernels for bf16
whenever the CPU reports AMX, in engine processes that never asked. The permission is per
process and cleared by ``execve``, so every interpreter must ask: ``ops/vllm-cpu-env.sh`` copies
this file into the engine's venv as ``_draftfleet_amx.py`` with a ``.pth`` that runs
:func:`at_start` as each interpreter starts (spawned workers too). Where the CPU has no AMX it
asks nothing.

Standalone on purpose (the standard library and msgspec, which vLLM itself needs): it runs in
the engine's venv, which holds none of the fleet. ``python -m draftfleet.amx`` checks a host.
"""

from __future__ import annotations

import ctypes
import errno as errnos
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86_64
MODULE = "_draftfleet_amx"  # its name in the engine's venv
PTH_LINE = f"import {MODULE}; {MODULE}.at_start()\n"
LOG_ENV = "DRAFTFLEET_AMX_LOG"  # set (by the launcher): each process says what it got, on stderr
CPUINFO_ENV = "DRAFTFLEET_AMX_CPUINFO"  # tests: a stand-in for /proc/cpuinfo
# The kernel's answers that mean "this kernel cannot give AMX" rather than a failure: an unknown
# arch_prctl code (Linux before 5.16), AMX not enabled by the kernel, a sandbox without the call.
_UNSUPPORTED = frozenset({errnos.EINVAL, errnos.EOPNOTSUPP, errnos.ENOSYS})

Outcome = Literal["granted", "not_supported", "no_amx", "error"]
Syscall = Callable[[int, int], tuple[int, int]]  # (code, arg) -> (result, errno)


class AmxGrant(msgspec.Struct, frozen=True):
    """What the kernel answered this process: ``granted``; ``not_supported`` (errno says why);
    ``no_amx`` (the CPU reports none: nothing asked); ``error`` (any other errno)."""

    outcome: Outcome
    errno: int = 0
    detail: str = ""


def cpu_flags(path: str | None = None) -> frozenset[str]:
    """The first CPU's flags (empty where there is no /proc/cpuinfo or no flags line)."""
    path = path or os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo"
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _arch_prctl(code: int, arg: int) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(arg))
    return int(result), ctypes.get_errno() if result else 0


def request(flags: frozenset[str] | None = None, syscall: Syscall | None = None) -> AmxGrant:
    """Ask for AMX tile state where the CPU reports ``amx_tile``; never raises.
    ``flags`` and ``syscall`` stand in for /proc/cpuinfo and the kernel in tests."""
    flags = cpu_flags() if flags is None else flags
    if "amx_tile" not in flags:
        return AmxGrant("no_amx", detail="the CPU reports no amx_tile: nothing asked")
    if syscall is None and (sys.platform != "linux" or platform.machine() != "x86_64"):
        return AmxGrant("not_supported", detail=f"arch_prctl is Linux x86_64 only ({sys.platform} {platform.machine()})")
    try:
        result, err = (syscall or _arch_prctl)(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:  # no libc to call through
        return AmxGrant("error", detail=f"cannot call arch_prctl: {exc}")
    if result == 0:
        return AmxGrant("granted", detail="arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) = 0")
    name = errnos.errorcode.get(err, str(err))
    why = f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {name} ({os.strerror(err)})"
    if err in _UNSUPPORTED:
        why += ": the kernel gives no AMX state here (before Linux 5.16, AMX off, or no AMX in this CPU)"
        return AmxGrant("not_supported", errno=err, detail=why)
    return AmxGrant("error", errno=err, detail=why)


AT_START: AmxGrant | None = None  # what :func:`at_start` got in this process


def at_start() -> None:
    """Run by the engine venv's ``.pth`` in every interpreter: ask, keep the answer in
    ``AT_START``, and with ``DRAFTFLEET_AMX_LOG`` set say it in one line on stderr (the engine's
    log). Must never fail an interpreter's start."""
    global AT_START
    try:
        AT_START = request()
        if os.environ.get(LOG_ENV) and AT_START.outcome != "no_amx":
            print(f"draftfleet amx (pid {os.getpid()}): {AT_START.outcome}: {AT_START.detail}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a start-up hook must not stop the interpreter
        pass


def attention_kernels(flags: frozenset[str], dtype: str = "bfloat16") -> str:
    """The kernels vLLM's CPU attention picks here (``_get_attn_isa``, block sizes a multiple of 32,
    head sizes a multiple of 32): ``amx`` for bf16 where the CPU reports AMX, else ``vec``."""
    vec = "vec (AVX-512)" if "avx512f" in flags else "vec (AVX2)" if "avx2" in flags else "vec"
    bf16 = dtype in ("bfloat16", "bf16", "auto")  # auto: the model's own dtype, bf16 for the fleet's models
    return "amx" if "amx_tile" in flags and bf16 else vec


def summary(flags: frozenset[str] | None = None, dtype: str = "bfloat16", asks: bool | None = None) -> str:
    """One line for a log: AMX present or absent, whether the engine's processes ask for it, and
    the attention kernels that follow (``asks``: None when unknown)."""
    flags = cpu_flags() if flags is None else flags
    kernels = attention_kernels(flags, dtype)
    if "amx_tile" not in flags:
        return f"AMX: absent; vLLM CPU attention will use {kernels} kernels ({dtype})"
    how = {True: f"each engine process asks for it ({MODULE}.pth)",
           False: f"the engine's venv has no {MODULE}.pth, so its processes never ask: the amx kernels die "
                  "with SIGILL (exit -4); build it with ops/vllm-cpu-env.sh or `python -m draftfleet.amx install PYTHON`",
           None: "granted to each engine process that asks"}[asks]
    return f"AMX: present, {how}; vLLM CPU attention will use {kernels} kernels ({dtype})"


def site_packages(python: str | Path) -> Path | None:
    """The site-packages folder of the venv whose interpreter is ``python`` (None: none found)."""
    found = sorted(Path(python).parent.parent.glob("lib/python3*/site-packages"))
    return found[-1] if found else None


def installed(python: str | Path) -> bool:
    """Whether the venv of ``python`` asks for AMX at each start (its ``.pth`` is in place)."""
    site = site_packages(python)
    return site is not None and (site / f"{MODULE}.pth").is_file() and (site / f"{MODULE}.py").is_file()


def install(site: str | Path) -> Path:
    """Copy this module into ``site`` (a venv's site-packages) as ``_draftfleet_amx.py`` with the
    ``.pth`` that runs it at every interpreter start; each file written whole, then renamed."""
    site = Path(site)
    for name, data in ((f"{MODULE}.py", Path(__file__).read_bytes()), (f"{MODULE}.pth", PTH_LINE.encode())):
        tmp = site / f".{name}.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, site / name)
    return site / f"{MODULE}.pth"


def _check(python: str | None) -> int:
    import subprocess

    flags = cpu_flags()
    amx = sorted(f for f in flags if f.startswith("amx"))
    print(f"cpu: {cpu_model()}; AMX flags: {' '.join(amx) or 'none'}")
    if python is None:
        grant = request(flags)
        print(f"this process: {grant.outcome}{f' (errno {grant.errno})' if grant.errno else ''}: {grant.detail}")
        print(summary(flags))
        return 0 if grant.outcome in ("granted", "no_amx") else 1
    said = f"import {MODULE} as m; print('{{}}:', m.AT_START.outcome if m.AT_START else 'never asked')"
    probe = (f"import multiprocessing as mp\nexec({said.format('engine process')!r})\n"
             f"p = mp.get_context('spawn').Process(target=exec, args=({said.format('its spawned child')!r},))\n"
             "p.start(); p.join()\n")
    res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    print((res.stdout.strip() or res.stderr.strip()[-500:]) or f"{python}: exit {res.returncode}")
    asks = installed(python) and res.returncode == 0
    print(summary(flags, asks=asks))
    return 0 if asks or "amx_tile" not in flags else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m draftfleet.amx [--python VENV/bin/python]``: what this host's kernel answers
    (and what that venv's engine processes get); ``... install SITE_PACKAGES``: put the hook there."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m draftfleet.amx", description=main.__doc__)
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--python", help="an engine venv's interpreter: check that its processes ask for AMX")
    inst = sub.add_parser("install", help="put the hook into a venv's site-packages")
    inst.add_argument("site", help="the venv's site-packages folder")
    args = parser.parse_args(argv)
    if args.command == "install":
        print(install(args.site))
        return 0
    return _check(args.python)


if __name__ == "__main__":
    sys.exit(main())
