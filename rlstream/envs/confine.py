"""Kernel confinement a sandboxed child installs on itself, unprivileged, before it runs code.

Pure standard library (ctypes): the sandbox embeds this file's source in the child's
preamble, so the child imports nothing of rlstream. Two layers, each under ``no_new_privs``:

- **Landlock** (Linux 5.13+): the child may read (and execute) only the directories it is
  given (the interpreter, site-packages, the tool's own package) and write only its working
  directory; everything else on the file system is refused, ``/proc/<parent>/environ``, the
  run directory, checkpoints, ``$HOME`` and the venv included. From ABI 4 TCP bind and connect
  are refused too; from ABI 6 the child cannot signal, or reach the abstract Unix sockets of,
  processes outside its domain.
- **seccomp** (a BPF filter): ``socket(AF_INET | AF_INET6 | AF_PACKET)`` fails with EACCES;
  ``ptrace``, ``process_vm_readv/writev``, ``io_uring_setup`` (io_uring opens sockets
  without ``socket()``), ``setsid`` and ``setpgid`` fail with EPERM, so every descendant
  stays in the child's process group and dies with it. A syscall of another ABI (x32) is
  refused; a foreign architecture kills the process.
"""

import ctypes
import os
import platform
import struct

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
# access rights per ABI version: files (read, write, make, remove, refer, truncate, ioctl on
# devices), then TCP bind/connect (ABI 4), then scopes (ABI 6)
_FS_BITS = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}
_FS_READ = 1 << 0 | 1 << 2 | 1 << 3  # execute, read a file, read a directory
_FILE_ONLY = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15  # what a rule on a file (not a directory) may allow
_NET_TCP = 1 << 0 | 1 << 1
_SCOPES = 1 << 0 | 1 << 1  # abstract Unix sockets, signals

# (audit arch, syscalls refused with EPERM, socket) per machine
_ARCH = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "io_uring_setup": 425,
                            "setsid": 112, "setpgid": 109}, 41),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "io_uring_setup": 425,
                             "setsid": 157, "setpgid": 154}, 198),
}
_AF_REFUSED = (2, 10, 17)  # AF_INET, AF_INET6, AF_PACKET
_EPERM, _EACCES = 1, 13
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or a seccomp profile hides it)."""
    abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION)
    return max(0, abi)


def _no_new_privs() -> None:
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_NO_NEW_PRIVS)")


def landlock(read: list[str], write: list[str]) -> int:
    """Confine this process to reading ``read`` and reading and writing ``write`` (each a
    directory or a file, with everything beneath); returns the ABI it used."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("this kernel has no Landlock")
    fs = (1 << _FS_BITS.get(abi, 16)) - 1
    attr = struct.pack("=QQQ", fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    try:
        for paths, allowed in ((read, _FS_READ), (write, fs)):
            for path in paths:
                _allow(ruleset, path, allowed)
        _no_new_privs()
        if _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def _allow(ruleset: int, path: str, allowed: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not os.path.isdir(path):
            allowed &= _FILE_ONLY
        rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
        if _libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
            raise _fail(f"landlock_add_rule {path}")
    finally:
        os.close(fd)


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jt, jf, k) instructions, for ``machine`` (platform.machine())."""
    arch, refused, socket_nr = _ARCH[machine]
    prog = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _RET_KILL_PROCESS), (_LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":  # x32 syscalls carry bit 30
        prog += [(_JGE_K, 0, 1, 0x40000000), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)]
    for nr in refused.values():
        prog += [(_JEQ_K, 0, 1, nr), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)]
    prog += [(_JEQ_K, 1, 0, socket_nr), (_RET_K, 0, 0, _RET_ALLOW), (_LD_W_ABS, 0, 0, 16)]  # args[0], low word
    for family in _AF_REFUSED:
        prog += [(_JEQ_K, 0, 1, family), (_RET_K, 0, 0, _RET_ERRNO | _EACCES)]
    return [*prog, (_RET_K, 0, 0, _RET_ALLOW)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp() -> None:
    """Install the filter of :func:`seccomp_program` on this process (and its descendants)."""
    prog = seccomp_program(platform.machine())
    code = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    _no_new_privs()
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise _fail("prctl(PR_SET_SECCOMP)")


def confine(read: list[str], write: list[str]) -> str:
    """Both layers; returns what was installed (``landlock+seccomp``), or raises OSError."""
    landlock(read, write)
    seccomp()
    return "landlock+seccomp"
