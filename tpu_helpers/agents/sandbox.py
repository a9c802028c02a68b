"""A Python tool safe to hand to a policy: model-written code runs in a separate, isolated, limited process.

    TOOLS = "tpu_helpers.agents.sandbox:python"            # a fresh interpreter per call
    ENVIRONMENT = "tpu_helpers.agents.sandbox:PythonSession"   # one interpreter per episode, state kept between calls
    box = Sandbox(Limits(wall_s=5)); box.run("print(2**10)")   # '1024'; box.layers: what holds, measured

`python(code)` returns what the code printed (stdout and stderr; the value of a last line that is an expression too,
as in a notebook cell), then the error's last line if it raised; a run past its limits, a crash or a flood of output
is a message and the next call works. Output is cut at `Limits.output_chars` with a marker. Each call runs in a worker
that sandbox_worker.py isolates before it reads code: network, mount and pid namespaces (no network, loopback
included; the home folders hidden; /dev down to null, zero, full, random and urandom; every mount read-only but a
private tmpfs, its working folder, gone with it; the whole process tree ends with it), its own uid (so the process
cap holds), Landlock and seccomp where the kernel has them, resource limits and an environment of allow-listed
variables. The first sandbox of a process probes what holds by running hostile checks in a worker and prints one
line saying so (docs/guides/security.md reads it); nothing is claimed that the probe did not see. Workers start
ahead of need (warm) and serve one call each, so no state passes between calls; at most `concurrency` (the cores)
run at once.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from tpu_helpers.core.choices import ConfigError

HIDE = ("/root", "/home", "/content", "/kaggle", "/mnt", "/media", "/run/secrets", "/var/run/secrets", "/var/colab")
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
UIDS = 4096  # the worker uids in use at once, from a base above any account's
# One counter for every sandbox of the process, from a random start so that two processes rarely share a uid.
_UID_COUNTER = itertools.count(random.SystemRandom().randrange(UIDS))
WORKER_SOURCE = (Path(__file__).with_name("sandbox_worker.py")).read_text()


@dataclass(frozen=True)
class Limits:
    """Per call: `wall_s` and `cpu_s` seconds, `memory_mb` of address space, `processes` (threads count),
    `file_mb` per written file, `tmp_mb` for the working folder, `output_chars` returned. A session's interpreter
    has 30 x cpu_s of CPU in all."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 32
    file_mb: int = 16
    tmp_mb: int = 64
    output_chars: int = 4000

    def __post_init__(self):
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"sandbox limit {name}={value!r}; give a number above 0")
        for name in ("cpu_s", "memory_mb", "processes", "file_mb", "tmp_mb", "output_chars"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"sandbox limit {name}={getattr(self, name)!r}; give a whole number")


def _uid_base() -> int:
    """A uid range no account uses, inside this user namespace's map (a container may map only 0-65535)."""
    try:
        ranges = [tuple(map(int, line.split())) for line in Path("/proc/self/uid_map").read_text().splitlines()]
    except OSError:
        ranges = [(0, 0, 65536)]
    top = max(inside + count for inside, _, count in ranges)
    return 2_000_000_000 if top > 2_000_000_000 + UIDS else max(top - UIDS - 2, 1000)


def _keep_paths() -> list[str]:
    """The interpreter's own folders: bound back read-only where they lie under a hidden one (a venv or pyenv in
    /root), so the worker's standard library and site-packages stay importable."""
    import site
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))), *site.getsitepackages()}
    return sorted(p for p in paths if p and os.path.isdir(p))


def _clean(data: bytes, total: int, limit: int) -> str:
    """Printed bytes as text a tokenizer takes: invalid UTF-8 and control characters become U+FFFD; cut at `limit`
    characters with a marker saying how much was printed."""
    text = data.decode("utf-8", errors="replace")
    text = "".join(c if c >= " " or c in "\n\t" else "\ufffd" for c in text).replace("\x7f", "\ufffd")
    if len(text) > limit or total > len(data):
        text = text[:limit] + f"\n[output truncated: {total:,} bytes printed, the first {min(limit, len(text)):,} " \
                              "characters shown]"
    return text


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of a worker's own uid (what a snippet started and detached, without a pid namespace)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


class Garbled(Exception):
    """A message on the control pipe that the worker's own code does not write."""


class Worker:
    """One isolated interpreter (see sandbox_worker.py) and the pipes to it."""

    def __init__(self, box: Sandbox):
        self.box = box
        self.uid = box.uid_base + next(box.uids) % UIDS
        box.uids_used.add(self.uid)
        self.workdir = tempfile.mkdtemp(prefix="tpu_helpers-sandbox-")
        self.pid: int | None = None
        self.report: dict | None = None
        self.buffer = b""
        self.ended = False  # the worker closed its end: it died
        if os.geteuid() == 0:
            os.chown(self.workdir, self.uid, self.uid)
        os.chmod(self.workdir, 0o700)
        ctl_r, ctl_w = os.pipe()
        out_r, out_w = os.pipe()
        life_r, self.life_w = os.pipe()
        cfg = {"ctl": ctl_w, "life": life_r, "uid": self.uid, "gid": self.uid, "workdir": self.workdir,
               "hide": box.hide, "keep": box.keep, "namespaces": box.namespaces, "landlock": box.landlock,
               "seccomp": box.seccomp, "memory_mb": box.limits.memory_mb, "processes": box.limits.processes,
               "file_mb": box.limits.file_mb, "tmp_mb": box.limits.tmp_mb, "cpu_hard_s": 30 * box.limits.cpu_s}
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-u", "-c", WORKER_SOURCE, json.dumps(cfg)],
                                         stdin=subprocess.PIPE, stdout=out_w, stderr=out_w, pass_fds=(ctl_w, life_r),
                                         env=box.env(self.workdir), cwd="/", start_new_session=True)
        finally:
            for fd in (ctl_w, out_w, life_r):
                os.close(fd)
        self.ctl, self.out = ctl_r, out_r
        deadline = time.monotonic() + 30
        while self.report is None or self.pid is None:  # the two messages come in either order
            message = self._message(deadline)
            if message is None:
                out = [b"", 0, 4096]
                self.kill(out)
                raise RuntimeError(f"the sandbox worker did not start (exit status {self.proc.returncode}): "
                                   f"{out[0].decode(errors='replace')[-2000:]}")
            self.report = message.get("ready", self.report)

    def _message(self, deadline: float, out: list | None = None) -> dict | None:
        """The next message on ctl (None: the worker ended or the deadline passed); output read meanwhile goes to
        `out` ([bytes kept, bytes seen, limit]) so a flood never blocks the worker."""
        while True:
            if len(self.buffer) >= 4:
                n = struct.unpack("<I", self.buffer[:4])[0]
                if n > 1 << 20:
                    raise Garbled(f"a message of {n:,} bytes")
                if len(self.buffer) >= 4 + n:
                    try:
                        message = json.loads(self.buffer[4:4 + n])
                    except ValueError as err:
                        raise Garbled(str(err)) from None
                    self.buffer = self.buffer[4 + n:]
                    if not isinstance(message, dict):
                        raise Garbled(f"a {type(message).__name__}")
                    if "pid" in message and self.pid is None and isinstance(message["pid"], int):
                        # Taken once, before any code runs: the code can write to this pipe too, and the pid is
                        # what kill() signals as root.
                        self.pid = message["pid"]
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.ctl, self.out] if out is not None else [self.ctl], [], [], left)
            if self.out in ready:
                self._take(out)
            if self.ctl in ready:
                chunk = os.read(self.ctl, 65536)
                if not chunk:
                    self.ended = True
                    return None
                self.buffer += chunk

    def _take(self, out: list) -> bool:
        chunk = os.read(self.out, 1 << 20)
        if chunk:
            if len(out[0]) < out[2]:
                out[0] += chunk[:out[2] - len(out[0])]
            out[1] += len(chunk)
        return bool(chunk)

    def run(self, code: str, *, keep: bool) -> tuple[str, bool]:
        """The call's text, and whether the worker still serves (keep: it is not ended after the call)."""
        limits = self.box.limits
        out = [b"", 0, 4 * limits.output_chars + 4]
        request = json.dumps({"code": code, "cpu_s": limits.cpu_s, "sweep": keep}).encode()
        try:
            self.proc.stdin.write(struct.pack("<I", len(request)) + request)
            self.proc.stdin.flush()
            deadline = time.monotonic() + limits.wall_s
            message = self._message(deadline, out)
            while message is not None and "error" not in message:
                message = self._message(deadline, out)
            garbled = None
        except OSError:  # the request found no reader: the worker is gone
            message, garbled, self.ended = None, None, True
        except Garbled as err:
            message, garbled = None, err
        alive = message is not None and keep
        if message is None:
            self.kill(out)
            if garbled is not None:
                note = f"the sandbox's control pipe got {garbled} (the code wrote to it); the next call starts afresh"
            elif not self.ended:
                note = f"TimeoutError: the code ran past its {limits.wall_s:g} s limit and was stopped"
            else:
                note = self._death(self.proc.returncode)
            if keep:
                note += " (the interpreter was restarted: names defined in earlier calls are gone)"
        else:
            note = message["error"] if isinstance(message["error"], str) or message["error"] is None else \
                str(message["error"])
            if keep:
                while select.select([self.out], [], [], 0)[0] and self._take(out):
                    pass
            else:
                self.kill(out)
        text = _clean(out[0], out[1], limits.output_chars)
        return "\n".join(p for p in (text.rstrip("\n"), note) if p) or "(no output: print what you want to see)", alive

    def _death(self, code: int | None) -> str:
        limits = self.box.limits
        if code is not None and code > 128:
            name = _signal_name(code - 128)
            if name == "SIGXCPU":
                return f"TimeoutError: the code used its {limits.cpu_s} s of CPU time and was stopped"
            return f"the Python process ended ({name}); the next call starts a fresh one"
        return f"the Python process ended (exit status {code}); the next call starts a fresh one"

    def kill(self, out: list | None = None) -> None:
        """End the worker and everything it started; the output left in the pipe goes to `out`."""
        if self.pid:  # the outer process reaps it, then ends: killed first, it would leave a zombie behind
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        if os.geteuid() == 0 and not (self.report or {}).get("pid") == 1:
            _kill_uid(self.uid)
        try:
            self.proc.stdin.close()  # a worker waiting for a request ends on its own
        except OSError:
            pass
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        deadline = time.monotonic() + 1
        while out is not None and time.monotonic() < deadline and select.select([self.out], [], [], 0.1)[0] \
                and self._take(out):
            pass
        for fd in (self.ctl, self.out, self.life_w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)


class Sandbox:
    """Runs snippets in isolated workers (see the module docstring). `concurrency` calls at once (default: the
    cores), `warm` workers started ahead (default: concurrency; 0 starts each on demand). `namespaces`, `landlock`
    and `seccomp` switch those layers off (for measuring them); `hide` adds folders to hide. `layers` holds what the
    probe saw; `describe()` is the start-up line."""

    def __init__(self, limits: Limits | None = None, *, concurrency: int | None = None, warm: int | None = None,
                 hide: tuple[str, ...] = (), namespaces: bool = True, landlock: bool = True, seccomp: bool = True,
                 probe: bool = True):
        self.limits = limits if limits is not None else Limits()
        if not isinstance(self.limits, Limits):
            raise ConfigError(f"sandbox limits={limits!r}; give a Limits(...)")
        self.concurrency = concurrency or os.cpu_count() or 1
        self.warm = self.concurrency if warm is None else warm
        if self.concurrency < 1 or self.warm < 0:
            raise ConfigError(f"sandbox concurrency={concurrency!r}, warm={warm!r}; give concurrency >= 1, warm >= 0")
        home = os.path.realpath(os.path.expanduser("~"))
        self.hide = sorted({os.path.realpath(p) for p in (*HIDE, home, *hide) if os.path.realpath(p) != "/"})
        self.keep = _keep_paths()
        self.namespaces, self.landlock, self.seccomp = namespaces, landlock, seccomp
        self.uid_base, self.uids = _uid_base(), _UID_COUNTER
        self.uids_used: set[int] = set()  # the uids its workers ran as
        self.slots = threading.BoundedSemaphore(self.concurrency)
        self.idle: list[Worker] = []
        self.lock = threading.Lock()
        self.wanted = threading.Event()
        self.closed = False
        self.filler: threading.Thread | None = None
        self.layers: dict[str, str] = probe_layers(self) if probe else {}
        atexit.register(self.close)

    def env(self, workdir: str) -> dict[str, str]:
        """The worker's environment: the allow-list's variables and its own HOME and TMPDIR, nothing else."""
        env = {k: v for k, v in os.environ.items() if k in ENV_KEEP}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env.update(HOME=workdir, TMPDIR=workdir, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
        return env

    def worker(self) -> Worker:
        """A started worker: a warm one when there is one, else one started now; the pool is refilled behind."""
        w = None
        while w is None:
            with self.lock:
                w = self.idle.pop() if self.idle else None
            if w is None:
                break
            if w.proc.poll() is not None:  # it died waiting (killed from outside): never hand out a dead one
                w.kill()
                w = None
        if self.warm:
            self.wanted.set()
            if self.filler is None:
                self.filler = threading.Thread(target=self._fill, name="tpu_helpers-sandbox-warm", daemon=True)
                self.filler.start()
        return w if w is not None else Worker(self)

    def _fill(self) -> None:
        while not self.closed:
            self.wanted.wait()
            self.wanted.clear()
            while not self.closed and len(self.idle) < self.warm:
                try:
                    w = Worker(self)
                except Exception:  # noqa: BLE001 (a failed start shows in the call that starts one itself)
                    break
                with self.lock:
                    if self.closed:
                        w.kill()
                        return
                    self.idle.append(w)

    def run(self, code: str) -> str:
        """Run a snippet in a fresh isolated interpreter; what it printed, its error, or what stopped it."""
        if not isinstance(code, str):
            return f"the code must be a string of Python, not a {type(code).__name__}"
        with self.slots:
            return self.worker().run(code, keep=False)[0]

    def run_many(self, codes: list[str]) -> list[str]:
        """Several snippets at once (at most `concurrency` running), the answers in order."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, min(self.concurrency, len(codes)))) as pool:
            return list(pool.map(self.run, codes))

    def describe(self) -> str:
        """The start-up line: each layer and what the probe saw of it."""
        if not self.layers:
            return "sandbox: not probed"
        lost = [k for k, v in self.layers.items() if v.startswith("NOT")]
        return ("sandbox: " + "; ".join(f"{k} {v}" for k, v in self.layers.items()) +
                (f". NOT isolated here: {', '.join(lost)} (docs/guides/security.md)" if lost else
                 ". Every layer held in the probe."))

    def close(self) -> None:
        self.closed = True
        self.wanted.set()
        with self.lock:
            idle, self.idle = self.idle, []
        for w in idle:
            w.kill()


PROBE = """
import json, os, socket, resource, time
r = {"uid": os.getuid(), "pid": os.getpid(), "env": sorted(os.environ)}
try:
    s = socket.socket(); s.settimeout(2); s.connect(("127.0.0.1", PORT)); r["net"] = "connected"
except OSError as e:
    r["net"] = type(e).__name__ + ": " + str(e.strerror)
try:
    r["listed"] = sorted(os.listdir(HOME))[:100]
    r["home"] = "listed " + str(len(r["listed"]))
    if FILE:
        open(FILE, "rb").read(1); r["home"] = "read a file"
except OSError as e:
    r["home"] = "refused: " + type(e).__name__
try:
    open(os.path.join(OUTSIDE, "x"), "w").write("x")
except OSError as e:
    r["write"] = type(e).__name__
try:
    os.kill(CALLER, 0); r["signal"] = "can signal the caller"
except OSError as e:
    r["signal"] = type(e).__name__
r["limits"] = {n: resource.getrlimit(getattr(resource, n))[0] for n in ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE")}
kids = []
try:
    for _ in range(TRIES):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError:
    pass
r["forks"] = len(kids)
for k in kids:
    os.kill(k, 9)
    os.waitpid(k, 0)
print(json.dumps(r))
"""


def _home_file(home: str) -> str:
    """A readable regular file in the caller's home, to see whether the worker can read it ('' if none)."""
    for root in (home, os.path.join(home, ".cache"), os.path.join(home, ".config")):
        try:
            for entry in sorted(os.scandir(root), key=lambda e: e.name):
                if entry.is_file(follow_symlinks=False) and os.access(entry.path, os.R_OK):
                    return entry.path
        except OSError:
            continue
    return ""


def probe_layers(box: Sandbox) -> dict[str, str]:
    """What holds, seen from inside a worker: a TCP connection to a listener on the loopback, a read in the home,
    a write to a world-writable folder outside, a signal to this process, the user and the limits."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    outside = tempfile.mkdtemp(prefix="tpu_helpers-sandbox-probe-")
    os.chmod(outside, 0o777)
    home = os.path.realpath(os.path.expanduser("~"))
    values = (box.limits.processes + 4, listener.getsockname()[1], home, _home_file(home), outside, os.getpid())
    code = f"TRIES, PORT, HOME, FILE, OUTSIDE, CALLER = {values!r}\n{PROBE}"
    try:
        w = Worker(box)
        report = w.report
        text, _ = w.run(code, keep=False)
        wrote = os.path.exists(os.path.join(outside, "x"))
    finally:
        listener.close()
        shutil.rmtree(outside, ignore_errors=True)
    try:
        seen = json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        return {"probe": f"NOT run: the probe printed {text[:300]!r}"}
    return layers_from(box, report, seen, wrote)


def layers_from(box: Sandbox, report: dict, seen: dict, wrote: bool) -> dict[str, str]:
    """The layers, each with the mechanisms the worker set up and the probe's evidence."""
    on = [n for n in ("netns", "mountns", "pidns") if report.get(n) == "on"]
    lock = report.get("landlock", "off")
    sec = report.get("seccomp", "off")

    def why(*names: str) -> str:
        names_ = {"netns": "network namespace", "mountns": "mount namespace", "pidns": "pid namespace",
                  "landlock": "Landlock", "landlock_tcp": "Landlock", "seccomp": "seccomp"}
        held = {*on, "landlock"} if lock.startswith("on") else set(on)
        held |= {"landlock_tcp"} if "TCP" in lock else set()
        held |= {"seccomp"} if sec == "on" else set()
        return ", ".join(names_[n] for n in names if n in held) or "nothing"

    layers = {}
    uid = seen.get("uid")
    net = seen.get("net", "?")
    layers["network"] = ("NOT isolated: a TCP connection to the loopback went through" if net == "connected" else
                         f"off ({why('netns', 'seccomp', 'landlock_tcp')}; a loopback connection: {net})")
    home = seen.get("home", "?")
    root = os.path.realpath(os.path.expanduser("~"))
    bound = {os.path.relpath(p, root).split(os.sep)[0] for p in box.keep if p.startswith(root + os.sep)}
    leaked = sorted(set(seen.get("listed", [])) - bound)  # names bound back for the interpreter are not the home's
    if home.startswith("listed") and not leaked:
        home = "refused: only the interpreter's folders are there"
    by_uid = f"; uid {uid}" if uid else ""
    layers["home"] = (f"hidden ({why('mountns', 'landlock')}{by_uid})" if home.startswith("refused") else
                      f"NOT hidden: the worker {home} of {root} ({', '.join(leaked[:5])}...)")
    confined = "private tmpfs, the rest read-only" if report.get("readonly") == "on" else why("landlock") + by_uid
    layers["writes"] = ("NOT confined: a write outside its folder landed" if wrote else
                        f"only to its own folder ({confined}, {box.limits.tmp_mb} MiB, removed after)")
    how = str(report.get("uid", ""))
    layers["user"] = (f"uid {uid}" if how.isdigit() and uid else
                      "the caller's own uid (not root), 0 in its user namespace" if how.startswith("the caller") else
                      f"uid {uid}, the caller's (not root)" if uid else f"NOT dropped: {how}")
    layers["caller"] = ("NOT protected: the worker can signal this process" if seen.get("signal") ==
                        "can signal the caller" else f"out of reach (a signal to it: {seen.get('signal')})")
    forks = seen.get("forks", 0)
    layers["processes"] = (f"capped at {box.limits.processes} (the probe's forks stopped at {forks})"
                           if forks < box.limits.processes + 4 else
                           f"NOT capped: {forks} forks went through (RLIMIT_NPROC does not bind root)")
    layers["tree"] = ("pid namespace (the whole tree ends with the call)" if seen.get("pid") == 1 else
                      "session and uid sweep" if uid else "NOT contained: session only (a detached process lives on)")
    dev = report.get("dev", "")
    layers["devices"] = (f"{dev} (mount namespace)" if dev.startswith("only") else
                         "NOT limited: the host's /dev (an accelerator whose device file any uid may open is open)")
    extra = sorted(set(seen.get("env", [])) - set(box.env("").keys()))
    layers["environment"] = "allow-list only" if not extra else f"NOT scrubbed: {extra}"
    lim = box.limits
    layers["limits"] = (f"{lim.wall_s:g} s wall, {lim.cpu_s} s CPU, {lim.memory_mb} MiB memory, {lim.processes} "
                        f"processes, {lim.file_mb} MiB files, {lim.output_chars} characters of output")
    layers["landlock"], layers["seccomp"] = lock, sec
    return layers


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process's sandbox for `python` and PythonSession: built on first use, probed, its line printed once."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
            print(f"[tpu_helpers] {_default.describe()}", file=sys.stderr, flush=True)
        return _default


def python(code: str) -> str:
    """Run Python code in a fresh sandboxed interpreter (no network, no files kept) and return what it printed.

    Args:
        code: The Python source to run. Use print() to see values; a last line that is an expression is printed too.
    """
    return default_sandbox().run(code)


python.concurrent = True  # episodes may call it at once: each call is its own process, bounded by the cores


class PythonSession:
    """An environment with one interpreter per episode: names defined in one call are there in the next, as in
    notebook cells. Each call has the same limits as `python`; a call that runs past them restarts the interpreter
    (the reply says so). The interpreter ends with reset() (the next call starts a fresh one) or when the
    environment is dropped; its only public method is the tool."""

    def __init__(self, sandbox: Sandbox | None = None):
        self.sandbox = sandbox
        self.held: list[Worker | None] = [None]
        self.end = weakref.finalize(self, PythonSession._stop, self.held)

    @staticmethod
    def _stop(holder: list) -> None:
        if holder[0] is not None:
            holder[0].kill()
            holder[0] = None

    def reset(self, **row) -> None:
        """A fresh interpreter for the episode (started on the first call)."""
        self._stop(self.held)

    def python(self, code: str) -> str:
        """Run Python code in this episode's sandboxed interpreter and return what it printed; names defined by
        earlier calls are kept.

        Args:
            code: The Python source to run. Use print() to see values; a last line that is an expression is printed too.
        """
        box = self.sandbox or default_sandbox()
        if not isinstance(code, str):
            return f"the code must be a string of Python, not a {type(code).__name__}"
        with box.slots:
            if self.held[0] is None:
                self.held[0] = box.worker()
            text, alive = self.held[0].run(code, keep=True)
            if not alive:
                self.held[0] = None
        return text
