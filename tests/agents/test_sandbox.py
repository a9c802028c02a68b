"""The sandboxed python tool (agents/sandbox.py) against hostile code, called as an agent calls it: TOOLS loaded by
name into a Toolbox, and PythonSession through an Agent's episode. Each hostile call must return within its limit,
leave nothing behind (no process of a sandbox uid, no file outside, no secret in the reply), leave this process
alive, and the next call must work. Where the probe found a layer missing on this machine, only the assertion that
needs it is skipped, with the probe's words."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tpu_helpers.agents import Agent, Toolbox, load_tools
from tpu_helpers.agents import sandbox as sandbox_module
from tpu_helpers.agents.sandbox import Limits, PythonSession, Sandbox
from tpu_helpers.core.choices import ConfigError

pytestmark = pytest.mark.skipif(not Path("/proc/self/mountinfo").exists(), reason="the sandbox needs Linux")

WALL = 3.0
SECRETS = {"HF_TOKEN": "hf_sandbox_test_secret_1", "WANDB_API_KEY": "wandb_sandbox_test_secret_2"}


@pytest.fixture(scope="module")
def box():
    if sandbox_module._default is not None:  # another test's: its warm workers would count as left behind here
        sandbox_module._default.close()
        sandbox_module._default = None
    saved = {k: os.environ.get(k) for k in SECRETS}
    os.environ.update(SECRETS)  # before any worker starts: each is started with the secrets in this environment
    b = Sandbox(Limits(wall_s=WALL, cpu_s=3, memory_mb=768, processes=16, output_chars=500), concurrency=2, warm=1)
    yield b
    b.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def tools(box, monkeypatch):
    monkeypatch.setattr(sandbox_module, "_default", box)
    return Toolbox(load_tools("tpu_helpers.agents.sandbox:python"), timeout_s=30)


def held(box: Sandbox, layer: str) -> None:
    """Skip the calling assertion where the probe found the layer missing here."""
    if box.layers.get(layer, "NOT probed").startswith("NOT"):
        pytest.skip(f"the sandbox's {layer} layer does not hold on this machine: {box.layers.get(layer)}")


def sandbox_processes(box: Sandbox) -> list[int]:
    """Processes of the box's uids but its warm workers (once the pool is refilled)."""
    deadline = time.monotonic() + 5
    while len(box.idle) < box.warm and time.monotonic() < deadline:
        time.sleep(0.02)
    idle = {w.pid for w in box.idle}
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid in box.uids_used:
                out.append(int(entry))
        except OSError:
            pass
    return [p for p in out if p not in idle]


def hostile(tools: Toolbox, box: Sandbox, code: str) -> str:
    """The call's reply, checked: within the limit, nothing left running, and the next call works."""
    start = time.monotonic()
    reply = tools.call("python", {"code": code})
    assert time.monotonic() - start < WALL + 3, reply
    assert isinstance(reply, str) and len(reply) < 1000, reply[:300]
    assert sandbox_processes(box) == [], "a sandbox process outlived its call"
    assert tools.call("python", {"code": "print(6 * 7)"}) == "42"
    return reply


def test_the_tool_runs_code_and_answers_with_what_it_printed(tools):
    assert tools.schemas[0]["function"]["name"] == "python"
    assert tools.schemas[0]["function"]["parameters"]["required"] == ["code"]
    assert tools.call("python", {"code": "x = 3\nprint(x * 2)\nx ** 3"}) == "6\n27"
    assert tools.call("python", {"code": "1 / 0"}) == "ZeroDivisionError: division by zero (line 1)"
    assert tools.call("python", {"code": "def f(:"}).startswith("SyntaxError")
    assert tools.call("python", {"code": "import json, math, fractions; math.comb(10, 3)"}) == "120"
    assert tools.call("python", {"code": "y = 1"}).startswith("(no output")
    assert tools.call("python", {"code": "print(y)"}) == "NameError: name 'y' is not defined (line 1)"  # fresh


def test_an_infinite_loop_is_stopped_at_the_wall_clock_limit(tools, box):
    assert "TimeoutError" in hostile(tools, box, "while True:\n    pass")
    assert "TimeoutError" in hostile(tools, box, "import time\ntime.sleep(60)")


def test_the_cpu_limit_stops_a_busy_loop_before_the_wall_clock():
    busy = Sandbox(Limits(wall_s=20, cpu_s=1), concurrency=1, warm=0, probe=False)
    session = PythonSession(busy)
    try:
        for run in (busy.run, session.python):
            start = time.monotonic()
            assert "used its 1 s of CPU time" in run("while True:\n    pass")
            assert time.monotonic() - start < 10
        assert session.python("print('alive')") == "alive"  # a CPU stop raises in the cell: the session goes on
    finally:
        session.reset()
        busy.close()


def test_a_fork_bomb_stops_at_the_process_cap_and_its_tree_is_killed(tools, box):
    held(box, "processes")
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
            "    print('stopped at', n, type(e).__name__)")
    reply = hostile(tools, box, code)
    assert reply.startswith("stopped at") and int(reply.split()[2]) < box.limits.processes, reply
    assert "BlockingIOError" in reply
    hostile(tools, box, "import os\nwhile True:\n    os.fork()")  # the classic one: every copy forks too


def test_a_detached_grandchild_dies_with_the_call(tools, box):
    hostile(tools, box, "import subprocess\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('ok')")


def test_a_16_gib_allocation_fails_inside_the_sandbox(tools, box):
    assert "MemoryError" in hostile(tools, box, "x = bytearray(16 * 2**30)\nprint(len(x))")


def test_writes_land_only_in_its_own_folder(tools, box, tmp_path):
    held(box, "writes")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    targets = [open_dir / "escaped.txt", Path("/etc/tpu_helpers_sandbox_escape"),
               Path.cwd() / "tpu_helpers_sandbox_escape"]
    for target in targets:
        reply = hostile(tools, box, f"open({str(target)!r}, 'w').write('x')\nprint('wrote')")
        assert "wrote" not in reply and not target.exists(), reply
    reply = hostile(tools, box, "import os\nopen('mine.txt', 'w').write('x' * 10)\nprint(os.listdir('.'))")
    assert reply == "['mine.txt']"
    assert "File too large" in hostile(tools, box, f"open('big', 'wb').write(b'0' * {17 * 2**20})")


def test_the_environment_has_no_secrets(tools, box):
    reply = hostile(tools, box, "import os\nprint(dict(os.environ))")
    for name, value in SECRETS.items():
        assert name not in reply and value not in reply, reply
    reply = hostile(tools, box, f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")
    assert not any(v in reply for v in SECRETS.values()), reply


def test_the_home_folder_cannot_be_read(tools, box):
    held(box, "home")
    home = Path.home()
    secret = home / f".tpu_helpers_sandbox_test_{os.getpid()}"
    secret.write_text("the home secret 3")
    secret.chmod(0o644)  # readable by any uid: only hiding the home protects it
    try:
        reply = hostile(tools, box, f"print(open({str(secret)!r}).read())")
        assert "the home secret 3" not in reply and "Error" in reply, reply
        reply = hostile(tools, box, f"import os\nprint(os.listdir({str(home)!r}))")
        assert secret.name not in reply, reply
    finally:
        secret.unlink()


def test_no_connection_to_a_loopback_listener(tools, box):
    held(box, "network")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\n"
                "print('connected')")
        reply = hostile(tools, box, code)
        assert "connected" not in reply and "Error" in reply, reply
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_a_100_mb_print_is_cut_with_a_marker(tools, box):
    reply = hostile(tools, box, "print('x' * 100_000_000)")
    assert reply.startswith("x" * 500) and "output truncated: 100,000,001 bytes printed" in reply


def test_binary_junk_and_a_self_kill_are_messages(tools, box):
    reply = hostile(tools, box, "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 2)")
    assert all(c >= " " or c in "\n\t" for c in reply)
    reply = hostile(tools, box, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert "SIGKILL" in reply or box.layers["tree"].startswith("pid namespace")  # pid 1 there: the kernel ignores it
    assert "exit status 3" in hostile(tools, box, "import os\nprint('bye')\nos._exit(3)")
    assert "SIGSEGV" in hostile(tools, box, "import ctypes\nctypes.string_at(0)")


def test_forged_control_messages_neither_kill_a_process_nor_break_the_caller(tools, box):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        for message in (f'{{"pid": {victim.pid}}}', '{"error": ["forged"]}', "not json"):
            code = (f"import json, os, struct, sys\nctl = json.loads(sys.argv[1])['ctl']\nm = {message!r}.encode()\n"
                    "os.write(ctl, struct.pack('<I', len(m)) + m)\nimport time\ntime.sleep(0.5)")
            hostile(tools, box, code)
        hostile(tools, box, "import json, os, struct, sys\nos.write(json.loads(sys.argv[1])['ctl'], b'\\xff' * 8)")
        assert victim.poll() is None  # the parent signals only the pid the worker's outer process sent, before code
    finally:
        victim.kill()
        victim.wait()


def test_the_caller_cannot_be_killed(tools, box):
    held(box, "caller")
    for target in ("os.getppid()", str(os.getpid()), "1"):
        hostile(tools, box, f"import os, signal\nos.kill({target}, signal.SIGKILL)")
    # this process lives: it is running this line


def test_deleting_files_touches_only_its_own_folder(tools, box, tmp_path):
    held(box, "writes")
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    code = (f"import os, shutil\nfor f in os.listdir('.'):\n    os.remove(f)\nshutil.rmtree({str(tmp_path)!r}, "
            f"ignore_errors=True)\nos.remove({str(keep)!r})")
    hostile(tools, box, code)
    assert keep.read_text() == "mine"
    assert (Path.cwd() / "pyproject.toml").exists()


def test_a_warm_worker_killed_while_it_waited_is_not_handed_out(tools, box):
    assert tools.call("python", {"code": "print(1)"}) == "1"
    sandbox_processes(box)  # the pool refilled
    for w in list(box.idle):
        os.kill(w.pid, 9)
        w.proc.wait()
    assert tools.call("python", {"code": "print(2)"}) == "2"


def test_snippets_run_at_once_up_to_the_concurrency(box):
    start = time.monotonic()
    replies = box.run_many([f"import time\ntime.sleep(1)\nprint({i})" for i in range(4)])
    assert replies == ["0", "1", "2", "3"]
    assert time.monotonic() - start < 4 * 1.0  # two at a time, not one after the other


def test_a_session_keeps_names_between_calls_and_restarts_after_a_timeout(box):
    agent = Agent(environment_factory=lambda: PythonSession(box), reward_funcs=[lambda completions, **_: [0.0]])
    episode = agent.start({"prompt": "compute"})
    assert [s["function"]["name"] for s in episode.schemas] == ["python"]

    def run(code: str) -> str:
        message = {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]}
        return episode.answer(message)[0]["content"]

    assert run("x = 21") .startswith("(no output")
    assert run("x * 2") == "42"
    assert run("import os\nif os.fork() == 0:\n    import time; time.sleep(60)\nprint('parent')") == "parent"
    assert sandbox_processes(box) == [episode.environment.held[0].pid]  # the cell's child was ended with it
    assert "restarted" in run("while True: pass")
    assert run("print('x' in dir())") == "False"
    assert run("import sys\nprint(repr(sys.stdin.read()))\ninput()") == "''\nEOFError: EOF when reading a line (line 3)"
    assert run("print('next')") == "next"  # the requests are not the code's to read
    episode.environment.reset()
    assert sandbox_processes(box) == []


def test_bad_limits_are_refused_naming_the_value():
    with pytest.raises(ConfigError, match="wall_s=0"):
        Limits(wall_s=0)
    with pytest.raises(ConfigError, match="processes=2.5"):
        Limits(processes=2.5)


def test_the_session_loads_as_an_environment_value_and_starts_nothing_until_called(box):
    from tpu_helpers.agents import load_environment

    before = sandbox_processes(box)
    assert load_environment("tpu_helpers.agents.sandbox:PythonSession") is PythonSession
    session = PythonSession(box)
    assert session.reset(prompt="x") is None and session.held == [None] and sandbox_processes(box) == before
