"""AMX tile state for vLLM's CPU engine (issue 42): the piece that asks the kernel, run where the
engine runs it (a spawned process, an engine venv's every interpreter), and what it reports.

These hosts have no AMX, so the grant itself is seen only on one that has it; here the kernel's
answer to the real call (with a faked ``amx_tile`` flag) and every answer it can give are checked.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
import sys
import venv
from pathlib import Path

import msgspec
import pytest

from draftfleet import amx

REPO = Path(__file__).resolve().parent.parent
HOST_HAS_AMX = "amx_tile" in amx.cpu_flags()
AMX_CPUINFO = "processor\t: 0\nmodel name\t: Fake Xeon\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def _spawned(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def test_a_spawned_process_asks_only_where_the_cpu_has_amx():
    grant = _spawned(amx.request)
    if HOST_HAS_AMX:
        assert grant.outcome == "granted", grant
    else:  # nothing asked: harmless
        assert grant == amx.AmxGrant("no_amx", detail="the CPU reports no amx_tile: nothing asked")


def test_the_real_kernel_answers_a_faked_amx_flag_and_is_reported_as_it_answered():
    """The real arch_prctl, asked as if the CPU had AMX: whatever this kernel answers, the report
    says it, with an errno that matches the outcome; a CPU without AMX is never granted it."""
    grant = _spawned(amx.request, frozenset({"amx_tile"}))
    assert grant.outcome in ("granted", "not_supported"), grant  # "error": an answer no kernel should give here
    assert "ARCH_REQ_XCOMP_PERM" in grant.detail
    if grant.outcome == "granted":
        assert grant.errno == 0 and grant.detail.endswith("= 0") and HOST_HAS_AMX, grant
    else:  # this kernel refuses the state (EOPNOTSUPP on Linux 5.16+ without AMX, EINVAL before 5.16)
        assert grant.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS), grant
        assert f"{errno.errorcode[grant.errno]} ({os.strerror(grant.errno)})" in grant.detail, grant


@pytest.mark.parametrize(("answer", "outcome", "code", "words"), [
    ((0, 0), "granted", 0, "= 0"),
    ((-1, errno.EINVAL), "not_supported", errno.EINVAL, "EINVAL"),  # Linux before 5.16: no such arch_prctl
    ((-1, errno.EOPNOTSUPP), "not_supported", errno.EOPNOTSUPP, "(Operation not supported)"),
    ((-1, errno.EPERM), "error", errno.EPERM, "EPERM"),  # a sandbox's refusal
    ((-1, errno.ENOSPC), "error", errno.ENOSPC, "ENOSPC"),  # sigaltstack too small for the tile state
])
def test_every_answer_of_the_kernel_is_reported(answer, outcome, code, words):
    asked = []

    def kernel(op, arg):
        asked.append((op, arg))
        return answer

    grant = amx.request(frozenset({"amx_tile"}), kernel)
    assert asked == [(0x1023, 18)]  # ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    assert (grant.outcome, grant.errno) == (outcome, code) and words in grant.detail, grant
    assert amx.request(frozenset({"avx512f"}), kernel).outcome == "no_amx" and len(asked) == 1  # nothing asked


def test_a_call_that_cannot_be_made_is_an_error_not_a_crash():
    def no_libc(op, arg):
        raise OSError("libc.so.6: cannot open shared object file")

    grant = amx.request(frozenset({"amx_tile"}), no_libc)
    assert grant.outcome == "error" and "cannot call arch_prctl" in grant.detail


def _engine_venv(tmp_path: Path) -> Path:
    """A venv (no pip) with the hook installed, seeing this project's msgspec (vLLM's venv has its own)."""
    folder = tmp_path / "engine-venv"
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / "bin" / "python"
    site = amx.site_packages(python)
    (site / "0_msgspec.pth").write_text(str(Path(msgspec.__file__).parent.parent) + "\n")  # before the hook's
    assert not amx.installed(python)
    amx.install(site)
    assert amx.installed(python)
    return python


PROBE = """
import multiprocessing as mp, _draftfleet_amx as m

def report(q):
    import _draftfleet_amx as m
    q.put(m.AT_START)

if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=report, args=(q,))
    p.start()
    print(m.AT_START.outcome, m.AT_START.errno, q.get(timeout=60).outcome)
    p.join()
"""


@pytest.mark.parametrize("cpuinfo", [None, AMX_CPUINFO])
def test_every_interpreter_of_an_engine_venv_asks_as_it_starts(tmp_path, cpuinfo):
    python = _engine_venv(tmp_path)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env[amx.LOG_ENV] = "1"
    if cpuinfo is not None:
        (tmp_path / "cpuinfo").write_text(cpuinfo)
        env[amx.CPUINFO_ENV] = str(tmp_path / "cpuinfo")
    res = subprocess.run([str(python), str(script)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    main_outcome, code, child_outcome = res.stdout.split()
    want = amx.request(amx.cpu_flags(str(tmp_path / "cpuinfo")) if cpuinfo else None)  # what the kernel answers here
    assert (main_outcome, int(code), child_outcome) == (want.outcome, want.errno, want.outcome)
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("draftfleet amx (pid ")]
    if cpuinfo is None and not HOST_HAS_AMX:
        assert not said and not res.stderr.strip(), res.stderr  # no AMX: silent, nothing asked
    else:  # each process says in the engine's log what it got: the interpreter and its spawned child
        assert len(said) >= 2 and all(f": {want.outcome}: " in ln for ln in said), res.stderr
    check = subprocess.run([sys.executable, "-m", "draftfleet.amx", "--python", str(python)], capture_output=True,
                           text=True, env=env, timeout=120)
    assert "engine process: " + want.outcome in check.stdout and "its spawned child: " + want.outcome in check.stdout
    assert check.returncode == 0, check.stdout
    if cpuinfo is not None:
        assert "AMX: present, each engine process asks for it" in check.stdout, check.stdout


def test_the_check_names_a_venv_whose_processes_never_ask(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text(AMX_CPUINFO)
    monkeypatch.setenv(amx.CPUINFO_ENV, str(tmp_path / "cpuinfo"))
    folder = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(folder)
    assert amx.main(["--python", str(folder / "bin" / "python")]) == 1
    assert "SIGILL" in amx.summary(asks=False) and "ops/vllm-cpu-env.sh" in amx.summary(asks=False)


@pytest.mark.parametrize(("flags", "dtype", "kernels"), [
    ({"avx2", "avx512f", "amx_tile"}, "bfloat16", "amx"),
    ({"avx2", "avx512f", "amx_tile"}, "auto", "amx"),  # the model's own dtype: bf16 for the fleet's models
    ({"avx2", "avx512f", "amx_tile"}, "float16", "vec (AVX-512)"),  # vLLM's amx kernels are bf16 only
    ({"avx2", "avx512f"}, "bfloat16", "vec (AVX-512)"),
    ({"avx2"}, "bfloat16", "vec (AVX2)"),
])
def test_the_log_line_names_the_attention_kernels(flags, dtype, kernels):
    line = amx.summary(frozenset(flags), dtype, asks=True)
    assert f"vLLM CPU attention will use {kernels} kernels ({dtype})" in line
    assert line.startswith("AMX: present, each engine process asks" if "amx_tile" in flags else "AMX: absent;")


def test_the_engine_venv_script_installs_the_hook_and_is_rebuilt_when_it_changes():
    script = (REPO / "ops" / "vllm-cpu-env.sh").read_text()
    assert 'amx="$here/../draftfleet/amx.py"' in script
    assert 'hash=$(cat "$here/vllm-cpu-env.sh" "$amx" | sha256sum' in script  # the cache key covers the hook
    install = script.index('"$dir/bin/python" -I "$amx" install "$site"')
    assert install < script.index('"$dir/bin/python" -I "$amx" --python "$dir/bin/python"') < script.index(
        "touch \"$dir/.complete\"")
