"""The Python sandbox against real child processes: each limit stops what it should and the
run always returns."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import time

import psutil
import pytest

from rlstream.envs.sandbox import Limits, namespaces_available, run_function, run_python

FAST = Limits(timeout_s=3.0, cpu_s=1, memory_mb=256, max_output_bytes=4096)


async def test_a_plain_script_runs_and_its_output_comes_back():
    r = await run_python("print(6 * 7)", FAST)
    assert r.ok and r.stdout == "42\n" and r.reason is None


async def test_an_exception_is_an_exit_code_with_its_traceback():
    r = await run_python("raise ValueError('bad input')", FAST)
    assert r.returncode == 1 and r.reason is None and "ValueError: bad input" in r.stderr


async def test_a_cpu_loop_is_killed_by_the_cpu_limit():
    start = time.monotonic()
    r = await run_python("while True: pass", Limits(timeout_s=20.0, cpu_s=1))
    assert r.reason == "cpu", (r.returncode, r.stderr)
    assert time.monotonic() - start < 15  # the CPU limit, not the 20 s wall limit, ended it


async def test_a_memory_bomb_is_refused():
    r = await run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)
    assert r.reason == "memory" and "allocated" not in r.stdout


async def test_a_sleeping_child_times_out_and_the_run_returns():
    # sleep uses no CPU: only the wall deadline can stop it; a grandchild in the group dies too
    code = "import subprocess, time\nprint(subprocess.Popen(['sleep', '300']).pid, flush=True)\ntime.sleep(300)"
    start = time.monotonic()
    r = await run_python(code, Limits(timeout_s=1.0))
    assert r.reason == "timeout" and time.monotonic() - start < 15  # 1 s bound, not the 300 s sleep; slack for a busy machine
    grandchild = int(r.stdout.split()[0])

    def gone() -> bool:
        try:
            return psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by init
        except psutil.NoSuchProcess:
            return True

    for _ in range(100):  # the kill is sent; init reaps the orphan when it gets to it
        if gone():
            break
        await asyncio.sleep(0.1)
    assert gone(), f"the grandchild {grandchild} outlived the run"


async def test_output_past_the_cap_is_cut_and_the_process_stopped():
    r = await run_python("import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stdout.flush()\nimport time; time.sleep(60)",
                         Limits(timeout_s=30.0, max_output_bytes=4096))
    assert r.reason == "output" and r.truncated and r.stdout == "x" * 4096 and r.wall_s < 10


def unshare_works() -> bool:
    """Whether this host gives a process a user + network namespace, found out here, not by
    the code under test."""
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def kernel_confines() -> bool:
    """Whether this kernel offers Landlock (its ABI version, asked by syscall 444) and
    seccomp, found out here, not by the code under test."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    landlock = libc.syscall(444, None, ctypes.c_size_t(0), 1) >= 1
    with open("/proc/self/status") as f:
        return landlock and "Seccomp:" in f.read()


CONFINED = pytest.mark.skipif(not kernel_confines(), reason="this kernel offers no Landlock or seccomp: the sandbox fails closed here")


@CONFINED
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no-namespaces"])
async def test_the_network_is_refused(listener, monkeypatch, namespaces):
    """With or without namespaces (a pod's default seccomp profile refuses unshare): the
    child's own seccomp filter refuses the socket."""
    from rlstream.envs import sandbox

    if not namespaces:
        monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    elif not unshare_works():
        pytest.skip("this host refuses user namespaces (unshare)")
    socket.create_connection(("127.0.0.1", listener), timeout=5).close()  # the control: this process reaches it
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {listener}), timeout=2)\n"
            "except OSError as e:\n    print('refused', e.errno)\nelse:\n    print('connected')")
    r = await run_python(code, FAST)
    assert r.stdout.split() == ["refused", "13"], r.stdout + r.stderr  # EACCES, from seccomp
    assert r.isolation == ("namespace+landlock+seccomp" if namespaces else "landlock+seccomp")


@CONFINED
async def test_without_namespaces_the_child_reads_no_secret_writes_nothing_outside_and_cannot_escape(monkeypatch, tmp_path):
    """The shipped pods' case (no unshare): the parent's environment in /proc, a run
    directory, a checkpoint and the venv are out of reach; ptrace is refused; a grandchild
    cannot leave the process group that a kill reaches."""
    import os
    import sys

    from rlstream.envs import sandbox

    monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "broker.token").write_text("t0ken")
    venv_pth = os.path.join(sys.prefix, "planted.pth")
    environ = f"/proc/{os.getpid()}/environ"
    with open(environ, "rb") as f:  # the controls: this process reads them
        assert f.read(1)
    assert (run_dir / "broker.token").read_text() == "t0ken"
    code = f"""
import ctypes, os
def attempt(what, fn):
    try:
        fn()
        print(what, "done")
    except OSError as e:
        print(what, "refused", e.errno)
attempt("environ", lambda: open({environ!r}, "rb").read())
attempt("token", lambda: open({str(run_dir / "broker.token")!r}).read())
attempt("plant", lambda: open({str(run_dir / "planted.py")!r}, "w").write("x"))
attempt("venv", lambda: open({venv_pth!r}, "w").write("import os"))
attempt("own", lambda: open("scratch.txt", "w").write("mine"))
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", libc.ptrace(0, 0, 0, 0), ctypes.get_errno())  # PTRACE_TRACEME
attempt("setsid", lambda: os.setsid())
"""
    r = await run_python(code, FAST)
    assert r.isolation == "landlock+seccomp", r.stderr
    assert r.stdout.splitlines() == ["environ refused 13", "token refused 13", "plant refused 13", "venv refused 13",
                                     "own done", "ptrace -1 1", "setsid refused 1"], r.stdout + r.stderr
    assert not (run_dir / "planted.py").exists() and not os.path.exists(venv_pth)


def test_the_seccomp_program_gives_each_syscall_its_verdict():
    """The BPF filter, run by a small interpreter of its five instructions: verdicts worked
    out by hand from the syscall tables of x86_64 and aarch64."""
    import struct

    from rlstream.envs.confine import _ARCH, seccomp_program

    allow, kill = 0x7FFF0000, 0x80000000
    eperm, eacces = 0x00050000 | 1, 0x00050000 | 13

    def verdict(machine, nr, arg0=0, arch=None):
        data = struct.pack("=iIQ6Q", nr, arch if arch is not None else _ARCH[machine][0], 0, arg0, 0, 0, 0, 0, 0)
        prog, pc, acc = seccomp_program(machine), 0, 0
        while True:
            code, jt, jf, k = prog[pc]
            if code == 0x20:
                acc = struct.unpack_from("=I", data, k)[0]
            elif code == 0x06:
                return k
            elif code in (0x15, 0x35):
                pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
            pc += 1

    # x86_64: read 0, socket 41, ptrace 101, setsid 112, process_vm_readv 310, io_uring_setup 425
    assert verdict("x86_64", 0) == allow
    assert verdict("x86_64", 41, 2) == eacces and verdict("x86_64", 41, 10) == eacces and verdict("x86_64", 41, 17) == eacces
    assert verdict("x86_64", 41, 1) == allow  # AF_UNIX
    for nr in (101, 112, 109, 310, 311, 425):
        assert verdict("x86_64", nr) == eperm
    assert verdict("x86_64", 0x40000000 + 41) == eperm  # x32
    assert verdict("x86_64", 0, arch=0x40000003) == kill  # i386
    # aarch64: socket 198, ptrace 117, setsid 157
    assert verdict("aarch64", 198, 2) == eacces and verdict("aarch64", 198, 1) == allow
    assert verdict("aarch64", 117) == eperm and verdict("aarch64", 157) == eperm and verdict("aarch64", 63) == allow


async def test_without_namespaces_the_weak_sandbox_runs_only_when_allowed_by_name(monkeypatch, tmp_path):
    """A host that refuses namespaces and kernel confinement: the sandbox fails closed, and
    runs the code with the weak in-process socket block only when the caller allows that mode
    by name."""
    from rlstream.envs import sandbox
    from rlstream.envs.toolenv import ToolEnvironment

    monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    monkeypatch.setattr(sandbox, "confinement_available", lambda: "")
    marker = tmp_path / "ran"
    r = await run_python(f"open({str(marker)!r}, 'w').write('x')", FAST)
    assert r.reason == "no-sandbox" and r.isolation == "none" and not marker.exists()
    assert "not run" in r.describe(FAST)
    with pytest.raises(ValueError, match="sandbox: weak"):
        ToolEnvironment(["python"])  # refused at start, in one line, not at the first call
    assert ToolEnvironment(["python"], sandbox="weak").sandbox == "socket-blocked"

    weak = dataclasses.replace(FAST, allow_weak=True)
    r = await run_python("import socket\ntry:\n    socket.socket()\nexcept PermissionError as e:\n    print(e)", weak)
    assert r.isolation == "socket-blocked" and "network access is disabled" in r.stdout


@pytest.mark.skipif(not namespaces_available(), reason="unshare cannot create user namespaces here")
async def test_in_a_namespace_the_child_cannot_raise_its_limits_or_reach_any_address(monkeypatch, listener):
    """The network namespace alone (no seccomp filter): a server this process reaches on the
    host's loopback is out of the child's reach (its namespace has a loopback of its own, down);
    an address that no route reaches would prove nothing on an offline machine."""
    from rlstream.envs import sandbox

    monkeypatch.setattr(sandbox, "confinement_available", lambda: "")  # the namespace alone (the weak mode)
    socket.create_connection(("127.0.0.1", listener), timeout=5).close()  # the control: this process reaches it
    code = ("import resource, socket\n"
            "try:\n    resource.setrlimit(resource.RLIMIT_CPU, (100, 100)); print('raised')\n"
            "except ValueError: print('kept')\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {listener}), timeout=2); print('connected')\n"
            "except OSError as e: print(e.errno)\n")
    r = await run_python(code, dataclasses.replace(FAST, allow_weak=True))
    assert r.isolation == "namespace"
    kept, reached = r.stdout.split()
    assert kept == "kept" and reached in ("101", "111"), r.stdout + r.stderr  # ENETUNREACH, ECONNREFUSED


async def test_the_parent_environment_does_not_reach_the_child(monkeypatch):
    monkeypatch.setenv("RLSTREAM_SECRET_FOR_TEST", "s3cret")
    r = await run_python("import os; print(os.environ.get('RLSTREAM_SECRET_FOR_TEST'))", FAST)
    assert r.stdout.strip() == "None"


async def test_a_function_by_import_path_returns_its_value_and_what_it_printed():
    r = await run_function("math:gcd", {}, FAST)  # gcd() with no arguments is 0
    assert r.ok and r.extra == {"ok": True, "result": "0", "printed": "", "printed_dropped": 0}
    r = await run_function("tests.envs.user_tools:loud", {"n": 10_000_000}, FAST)
    assert r.extra["ok"] and r.extra["result"] == "done"
    assert len(r.extra["printed"]) == 1024 and r.extra["printed_dropped"] == 10_000_000 - 1024


async def test_a_function_that_raises_reports_the_error():
    r = await run_function("tests.envs.user_tools:fails", {"why": "no such city"}, FAST)
    assert r.extra == {"ok": False, "error": "LookupError: no such city", "printed": "", "printed_dropped": 0}


async def test_a_file_past_the_size_limit_is_refused_and_the_working_directory_is_removed():
    """``max_file_mb``: a write past it fails (EFBIG; Python ignores SIGXFSZ) and the file holds
    no more than the limit; the child's fresh working directory is gone once the run returns."""
    code = ("import os\nprint(os.getcwd())\n"
            "try:\n    open('big', 'wb').write(b'x' * (3 << 20))\nexcept OSError as e:\n    print(e.errno)\n"
            "print(os.path.getsize('big'))\n")
    r = await run_python(code, dataclasses.replace(FAST, max_file_mb=1, allow_weak=True))
    workdir, errno, size = r.stdout.split()
    assert errno == "27" and int(size) <= 1 << 20, r.stdout + r.stderr  # EFBIG
    assert workdir.startswith("/") and "rlstream-sandbox-" in workdir and not os.path.exists(workdir)
    # the control: under the limit the same write succeeds
    ok = await run_python("open('small', 'wb').write(b'x' * (512 << 10)); print('written')",
                          dataclasses.replace(FAST, max_file_mb=1, allow_weak=True))
    assert ok.stdout.split() == ["written"], ok.stdout + ok.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="the kernel exempts root (uid 0 outside any namespace) from RLIMIT_NPROC; "
                    "the shipped pods run as uid 10001")
async def test_a_fork_bomb_stops_at_the_process_limit():
    """``max_processes`` (RLIMIT_NPROC) for a producer that is not root: of 20 forks, at most
    that many succeed."""
    code = ("import os, time\nmade = 0\n"
            "for _ in range(20):\n"
            "    try:\n        pid = os.fork()\n    except OSError as e:\n        print('refused', e.errno); break\n"
            "    if pid == 0:\n        time.sleep(2); os._exit(0)\n"
            "    made += 1\n"
            "print('made', made)\n")
    r = await run_python(code, dataclasses.replace(FAST, max_processes=5, allow_weak=True))
    out = r.stdout.split()
    assert out[:2] == ["refused", "11"] and out[2] == "made" and int(out[3]) <= 5, r.stdout + r.stderr  # EAGAIN
