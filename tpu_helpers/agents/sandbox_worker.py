"""The sandbox's worker: the program `sandbox.py` starts as `python -I -u -c <this file's text> <settings as JSON>`.

It isolates itself before it reads any code (one fresh single-threaded interpreter, so nothing here runs in a forked
copy of the training process): namespaces (network, mount, pid, ipc, uts; a user namespace first when not root),
then in the mount namespace tmpfs over the home folders (the interpreter's own prefixes bound back read-only), a /dev
of harmless devices, a private tmpfs as /tmp (the working folder) and every other mount read-only. It then forks the
interpreter that runs code (pid 1 of the new pid namespace: when it ends, the kernel ends every process under it),
which mounts its /proc, sets the resource limits, drops to its own uid, and applies Landlock and seccomp where the
kernel has them. Each step that fails is recorded, never fatal: the report it sends says what holds, and the parent
says it once.

Pipes: fd 0 brings requests (moved off fd 0, which becomes /dev/null, before any code runs), fds 1 and 2 take the
output, `ctl` takes length-prefixed JSON messages (the outer process's `{"pid"}`, then `{"ready": report}` and one
`{"error"}` per request), `life` closes when the parent dies.
Standard library only: the worker runs with none of the package importable.
"""

import ast
import ctypes
import errno
import json
import math
import os
import resource
import select
import signal
import struct
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_FLAGS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME,
            4096: MS_RELATIME}  # statvfs f_flag bit -> mount flag: a bind remount must keep the locked ones
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.syscall.restype = ctypes.c_long


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    source, target, fstype, data = (s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data))
    _check(libc.mount(source, target, fstype, flags, data), f"mount {target.decode()}")


def send(fd, message):
    data = json.dumps(message).encode()
    os.write(fd, struct.pack("<I", len(data)) + data)


def read_exact(fd, n):
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def unshare(cfg, report):
    """The namespaces, one call each so the report says which the kernel refused."""
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        try:
            _check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"0 {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"0 {gid} 1")
            report["userns"] = "on"
        except OSError as err:
            report["userns"] = f"refused ({err})"
    for name, flag in (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS), ("pid", CLONE_NEWPID), ("ipc", CLONE_NEWIPC),
                       ("uts", CLONE_NEWUTS)):
        try:
            _check(libc.unshare(flag), f"unshare({name})")
            report[name + "ns"] = "on"
        except OSError as err:
            report[name + "ns"] = f"refused ({err.strerror})"


def mount_points():
    """The mount points, from /proc/self/mountinfo (octal escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            out.append(point.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape"))
    return out


def under(path, parent):
    return path == parent or path.startswith(parent.rstrip("/") + "/")


DEVICES = ("null", "zero", "full", "random", "urandom")


def minimal_dev():
    """A /dev of the harmless devices only (no accelerator, disk or terminal), as bubblewrap's --dev builds."""
    fds = {n: os.open("/dev/" + n, os.O_PATH) for n in DEVICES if os.path.exists("/dev/" + n)}
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name, fd in fds.items():
        open("/dev/" + name, "w").close()
        mount(f"/proc/self/fd/{fd}", "/dev/" + name, None, MS_BIND)
        os.close(fd)
    os.mkdir("/dev/shm")
    os.symlink("/proc/self/fd", "/dev/fd")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", "/dev/" + name)
    return "only " + ", ".join(fds)


def filesystem(cfg, report):
    """In the mount namespace: the home folders hidden, a private tmpfs as /tmp (and /dev/shm), the interpreter's
    folders bound back where those covered them, then every other mount read-only."""
    uid, gid = (0, 0) if report.get("userns") == "on" else (cfg["uid"], cfg["gid"])  # a user namespace maps only 0
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    private = [p for p in ("/tmp", "/dev/shm") if os.path.isdir(p)]
    covered = [*cfg["hide"], *private]
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in cfg["keep"]
           if os.path.isdir(p) and any(under(p, c) for c in covered)}
    hidden = []
    for h in cfg["hide"]:
        if os.path.isdir(h) and not os.path.islink(h) and not any(under(h, x) for x in hidden):
            mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
            hidden.append(h)
    report["hidden"] = hidden
    try:
        report["dev"] = minimal_dev()
    except OSError as err:
        report["dev"] = f"the host's ({err})"
    private = [p for p in private if os.path.isdir(p)]
    size = f"size={cfg['tmp_mb']}m,mode=0700,uid={uid},gid={gid}"
    for p in private:
        mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, size)
    if "/tmp" in private:  # from here on the host's folders under /tmp are out of sight, whatever fails next
        report["workdir"] = "/tmp"
    for p, fd in fds.items():
        os.makedirs(p, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        os.close(fd)
    failed = []
    for point in mount_points():
        if under(point, "/proc") or point in private:
            continue
        try:
            flags = sum(m for bit, m in ST_FLAGS.items() if os.statvfs(point).f_flag & bit)
            mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        except OSError as err:  # a mount under a hidden folder is out of reach: nothing to do
            failed.append(f"{point}: {err.strerror}")
    report["readonly"] = "on" if os.statvfs("/").f_flag & 1 else "refused"
    report["readonly_failed"] = failed[:5]


def limits(cfg, report):
    mib = 1 << 20
    for name, value in (("RLIMIT_AS", cfg["memory_mb"] * mib), ("RLIMIT_NPROC", cfg["processes"]),
                        ("RLIMIT_FSIZE", cfg["file_mb"] * mib), ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 256),
                        ("RLIMIT_CPU", cfg["cpu_hard_s"])):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (OSError, ValueError) as err:
            report.setdefault("limits_failed", []).append(f"{name}: {err}")


def reachable(path):
    """Whether another uid can reach a folder: every folder on the way lets others through."""
    while path not in ("/", ""):
        if not os.stat(path).st_mode & 0o001:
            return False
        path = os.path.dirname(path)
    return True


def drop_user(cfg, report):
    if os.geteuid() != 0 or report.get("userns") == "on":
        report["uid"] = f"{os.geteuid()} (not root to begin with)" if report.get("userns") != "on" else \
            "the caller's own (a user namespace)"
        return
    blocked = [p for p in cfg["keep"] if not reachable(p)]
    if blocked:
        report["uid"] = f"kept root: another uid cannot reach the interpreter's {blocked[0]} (no mount namespace)"
        return
    try:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        report["uid"] = str(os.getuid())
    except OSError as err:
        report["uid"] = f"refused ({err.strerror}): runs as root"


def landlock(cfg, report):
    """Writes only under the working folder; reads everywhere but the hidden folders (their kept prefixes aside); no
    TCP; no signals out of the sandbox (each where the kernel's Landlock ABI has it)."""
    nums = SYS_LANDLOCK.get(os.uname().machine)
    if nums is None:
        report["landlock"] = "unknown syscall numbers on this machine"
        return
    create, add, restrict = nums
    abi = libc.syscall(create, None, 0, 1)
    if abi < 1:
        report["landlock"] = f"not available ({os.strerror(ctypes.get_errno())})"
        return
    fs = (1 << 13) - 1
    fs |= (1 << 13) if abi >= 2 else 0
    fs |= (1 << 14) if abi >= 3 else 0
    fs |= (1 << 15) if abi >= 5 else 0
    net = 3 if abi >= 4 else 0
    scoped = 3 if abi >= 6 else 0
    attr = struct.pack("<QQQ", fs, net, scoped)[:8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(create, buf, len(attr), 0)
    if ruleset < 0:
        report["landlock"] = f"refused ({os.strerror(ctypes.get_errno())})"
        return
    read = 1 | 4 | 8  # execute, read file, read dir

    def allow(path, access):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        rule = ctypes.create_string_buffer(struct.pack("<Qi", access & fs, fd), 12)
        libc.syscall(add, ruleset, 1, rule, 0)
        os.close(fd)

    hide = cfg["hide"]
    for entry in os.listdir("/"):
        path = "/" + entry
        if path in ("/tmp", "/dev") or any(under(path, h) or under(h, path) for h in hide):
            continue
        allow(path, read)
    for h in hide:  # the parents of a hidden folder, but its siblings only
        parent = os.path.dirname(h)
        if parent != "/" and os.path.isdir(parent):
            for entry in os.listdir(parent):
                path = os.path.join(parent, entry)
                if not any(under(path, x) or under(x, path) for x in hide):
                    allow(path, read)
    for p in cfg["keep"]:
        allow(p, read)
    allow("/dev", read | 2 | (1 << 14) | (1 << 15))  # /dev/null (opened with O_TRUNC too), /dev/urandom
    allow(cfg["workdir"], fs)
    if os.path.isdir("/dev/shm") and report.get("mountns") == "on":
        allow("/dev/shm", fs)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(restrict, ruleset, 0) != 0:
        report["landlock"] = f"refused ({os.strerror(ctypes.get_errno())})"
    else:
        report["landlock"] = f"on (ABI {abi}" + ("; TCP denied" if net else "") + ("; signals scoped" if scoped
                                                                                   else "") + ")"
    os.close(ruleset)


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def seccomp(cfg, report):
    """libseccomp through ctypes, where the library is installed: no IPv4/IPv6/packet sockets, no io_uring (it
    opens sockets past the filter), no ptrace, mounts, namespaces, keyrings or bpf."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        # find_library runs ldconfig (tens of ms): only where the usual name is not found
        from ctypes.util import find_library

        name = find_library("seccomp")
        if not name:
            report["seccomp"] = "libseccomp is not installed"
            return
        lib = ctypes.CDLL(name, use_errno=True)
    try:
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(ArgCmp)]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        ctx = lib.seccomp_init(0x7FFF0000)  # allow by default
        deny = 0x00050000 | errno.EPERM
        socket = lib.seccomp_syscall_resolve_name(b"socket")
        for family in (2, 10, 17):  # AF_INET, AF_INET6, AF_PACKET
            cmp = (ArgCmp * 1)(ArgCmp(0, 4, family, 0))  # SCMP_CMP_EQ on argument 0
            _check(lib.seccomp_rule_add_array(ctx, deny, socket, 1, cmp), "seccomp rule socket")
        for call in ("io_uring_setup", "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2",
                     "pivot_root", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
                     "userfaultfd", "kexec_load"):
            nr = lib.seccomp_syscall_resolve_name(call.encode())
            if nr >= 0:
                _check(lib.seccomp_rule_add_array(ctx, deny, nr, 0, None), f"seccomp rule {call}")
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _check(lib.seccomp_load(ctx), "seccomp_load")
        lib.seccomp_release(ctx)
        report["seccomp"] = "on"
    except (OSError, AttributeError) as err:
        report["seccomp"] = f"refused ({err})"


def cell(code):
    """Run one snippet as a notebook cell in the worker's globals: the last expression's repr is printed. Returns
    None, or the error's last line."""
    try:
        tree = ast.parse(code, "<cell>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), SCOPE)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), SCOPE)
            if value is not None:
                print(repr(value))
        return None
    except BaseException as err:  # noqa: BLE001 (the snippet's failure is its answer)
        line = next((f.lineno for f in reversed(traceback.extract_tb(err.__traceback__))
                     if f.filename == "<cell>"), getattr(err, "lineno", None) if isinstance(err, SyntaxError) else None)
        text = traceback.format_exception_only(type(err), err)[-1].strip()
        return text + (f" (line {line})" if line else "")


SCOPE = {"__name__": "__main__", "__builtins__": __builtins__}


def serve(cfg, ctl, report):
    """The request loop of the interpreter that runs code; after each cell, processes it left behind are ended
    (where this interpreter is pid 1 or runs under its own uid, so that cannot reach anything else)."""
    me = os.getpid()
    sweep = me == 1 or report.get("uid", "").isdigit()
    budget = [0]

    def over_cpu(*_):  # a handler, not the default action: as pid 1 of its namespace the kernel would ignore that
        raise TimeoutError(f"the code used its {budget[0]} s of CPU time and was stopped")

    signal.signal(signal.SIGXCPU, over_cpu)
    requests = os.dup(0)  # off fd 0: input() or sys.stdin.read() in a cell must not eat the next request
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(errors="backslashreplace")
    sys.stderr.reconfigure(errors="backslashreplace")
    send(ctl, {"ready": report})
    while True:
        head = read_exact(requests, 4)
        if head is None:
            os._exit(0)
        request = json.loads(read_exact(requests, struct.unpack("<I", head)[0]))
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        budget[0] = request["cpu_s"]
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (min(math.ceil(used + request["cpu_s"]), cfg["cpu_hard_s"]),
                                                   cfg["cpu_hard_s"]))
        except (OSError, ValueError):
            pass
        error = cell(request["code"])
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 (a snippet may have closed them)
            pass
        if os.getpid() != me:  # a child the snippet forked ends here, never in the loop
            os._exit(0)
        if sweep and request.get("sweep", True):
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            try:
                while True:  # every one was killed: each is reaped here (orphans too, as pid 1), none left a zombie
                    os.waitpid(-1, 0)
            except ChildProcessError:
                pass
        send(ctl, {"error": error})


def main():
    cfg = json.loads(sys.argv[1])
    ctl, life = cfg["ctl"], cfg["life"]
    report = {}
    if cfg["namespaces"]:
        unshare(cfg, report)
    if report.get("mountns") == "on":
        try:
            filesystem(cfg, report)
        except OSError as err:
            report["filesystem"] = f"refused ({err})"
    if "workdir" not in report:
        report["workdir"] = cfg["workdir"]
    cfg["workdir"] = report["workdir"]
    pid = os.fork()
    if pid:  # the outer process: tells the parent the worker's pid, ends it when the parent goes
        send(ctl, {"pid": pid})
        for fd in (0, 1, 2, ctl):
            os.close(fd)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else min(code, 127))
            ready, _, _ = select.select([life, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 512)
            if life in ready and not os.read(life, 1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    os.close(life)
    if report.get("pidns") == "on":
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as err:
            report["proc"] = f"refused ({err.strerror})"
    limits(cfg, report)
    drop_user(cfg, report)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the uid change, which clears it
    os.chdir(cfg["workdir"])
    if cfg["landlock"]:
        landlock(cfg, report)
    if cfg["seccomp"]:
        seccomp(cfg, report)
    report["pid"] = os.getpid()
    serve(cfg, ctl, report)


if __name__ == "__main__":
    main()
