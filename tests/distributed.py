"""Run a function on N gloo ranks (forked processes) and collect each rank's result."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import gc
import importlib
import io
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch._dynamo  # once here: each forked rank would import it again
import torch.distributed as dist


def _start_autograd_before_any_compile() -> None:
    """One backward in this process, before anything compiles here. Autograd decides at
    its first backward whether to start per-device threads, and torch 2.14 does when
    dynamo has run before it (even with no GPU): every rank forked after that fails its
    first backward ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing"). Decided now, with no compile run, it starts none."""
    x = torch.ones(1, requires_grad=True)
    (x * 2).sum().backward()


_start_autograd_before_any_compile()


def preload(*modules: str) -> None:
    """Import `modules` in this process, the one that forks the ranks, so that each rank
    inherits them instead of importing them again: 0.2-0.9 s of CPU per rank for a
    Transformers model or trainer, the ranks of a test module import the same ones. One
    that is not installed is skipped (its tests skip themselves)."""
    for name in modules:
        with contextlib.suppress(ImportError), _torch_deprecations_quiet():
            importlib.import_module(name)


@contextlib.contextmanager
def _torch_deprecations_quiet():
    """Imported here, some of torch's compiler modules deprecate torch's own
    `torch.jit.script_method` at import (14 warnings): nothing a test can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated")
        yield


@functools.cache
def warm_the_compiler() -> None:
    """Compile a trivial function here once, with aot_eager and with inductor, so that
    the forked ranks inherit the compiler's modules and its lazily made state (the C++
    toolchain's probe, the pass registries): about 1.5 s of CPU per rank otherwise, spent
    again in each rank of each world that compiles. Inductor compiles in this process
    (`compile_threads=1`): a pool of compile workers would leave threads alive across the
    fork. Dynamo's caches and counters are then reset, so tests count only their own."""
    import torch._inductor.config as inductor_config

    x = torch.ones(2, requires_grad=True)
    with inductor_config.patch(compile_threads=1), _torch_deprecations_quiet():
        for backend in ("aot_eager", "inductor"):
            torch.compile(lambda t: (t * 2).sum(), backend=backend)(x).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


# Where a rank stands, for the parent to read when it hangs.
_BEFORE, _IN_FUNCTION, _RETURNED = 0, 1, 2


class _HarnessHang(TimeoutError):
    """Ranks hung outside the function under test (before its first line, or after it
    returned, sending the result): the harness's fork, not the code the test is about."""


class _TransportFailure(RuntimeError):
    """A rank's gloo connections to its peers failed while a group was made ("Gloo
    connectFullMesh failed ... Connection closed by peer", once in CI: a 4-rank world
    beside another test's on the runner's cores), and the ranks still connecting waited
    for it until the harness's deadline: the machine's loopback transport, not the code
    the test is about."""


# gloo's message when a rank could not connect to its peers while a group was made.
_TRANSPORT_FAILURE = "connectFullMesh failed"
_ATTEMPTS = 3


def _note_first_line(code, phase) -> None:
    """Set `phase` to _IN_FUNCTION when the frame of `code` runs its first line (tracing
    stops there); at once for a callable without code of its own."""
    if code is None:
        phase.value = _IN_FUNCTION
        return

    def first_line(frame, event, arg):
        if event == "line":
            phase.value = _IN_FUNCTION
            sys.settrace(None)
            return None
        return first_line

    def on_call(frame, event, arg):
        return first_line if frame.f_code is code else None

    sys.settrace(on_call)


def _worker(fn, rank, world_size, init_file, conn, args, kwargs, phase):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # The heap forked from pytest (every module it imported) is left out of this rank's
    # collections: a full one (the engine's close runs one) would walk it, ~0.1 s each.
    gc.freeze()
    # The rank holds the world group it makes until its own end, and lets go of it from
    # Python. Otherwise a function that destroys the default group (Accelerate's
    # `end_training()` does) while a torch DDP module is alive leaves the DDP Reducer with
    # the group's last reference; at the function's return the Reducer is freed holding the
    # GIL, and `~ProcessGroupGloo` waits for a gloo worker thread that waits for the GIL (to
    # free a Python object in a finished work's thread-local state): torch's deadlock, the
    # hangs CI saw in the DDP halves of the Accelerate tests. Released from Python, the
    # group's binding lets go of the GIL while its threads are joined. (It shows only where
    # the parent imported DeepSpeed: imported in the rank, DeepSpeed's
    # `barrier(group=GroupMember.WORLD)` default holds the world group for the rank's life.)
    # Only the world group is held: a subgroup destroyed under a live DDP could hang so too.
    world_group = None
    try:
        # A hung rank's stacks, on ask, to the process's own stderr: the test's may be a
        # capture with no file descriptor (capsys), where registering would fail.
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        world_group = dist.group.WORLD
        _note_first_line(getattr(fn, "__code__", None), phase)
        result = fn(rank, world_size, *args, **kwargs)
        phase.value = _RETURNED
        buffer = io.BytesIO()
        torch.save(result, buffer)  # tensors by value: the process exits before the parent reads
        # Sent from this thread, now: a multiprocessing.Queue sends from a feeder thread
        # that the process joins at exit, and a garbage collection running a finalizer in
        # that thread once left ranks hung there, their results never sent.
        conn.send(("ok", buffer.getvalue()))
    except BaseException as e:  # reported to the parent, which raises
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        del world_group


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    expect_errors: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Each rank runs fn(rank, world_size, *args); returns the results in rank order.

    With expect_errors, returns each rank's (status, payload) instead of raising; status is
    "ok", "error" (an exception) or "died" (the process was killed, e.g. by an abort).

    A world whose hung ranks all stood outside the function (before its first line, or
    after it returned, sending the result) is started once more, with a note on stderr.
    Those hangs (twice in CI, once here) had the look of torch's Reducer deadlock that
    `_worker` now avoids (a main thread with no Python frame above `_worker`, one gloo
    thread with a Python state waiting for the GIL), reached by a garbage collection
    rather than a return; the retry stays for a cause not yet seen. A hang inside the
    function fails. Either way the hung ranks' Python stacks and, where gdb is installed,
    their native stacks go to stderr. A world where gloo could not connect a rank to its
    peers (`_TransportFailure`) is started once more too. At most `_ATTEMPTS` starts in all:
    a real loopback failure came on the second start of the harness's own test of this
    (whose first start fails on purpose), the suite's two workers side by side."""
    for attempt in range(_ATTEMPTS):
        last = attempt == _ATTEMPTS - 1
        try:
            results = _run_once(fn, world_size, args, kwargs, timeout)
            if not last:
                _raise_on_transport_failure(results)
            break
        except (_HarnessHang, _TransportFailure) as e:
            if last:
                raise
            print(f"run_world: {e}; starting the world once more", file=sys.__stderr__)
    if expect_errors:
        return [results[r] for r in range(world_size)]
    errors = [
        f"rank {r}: {payload}" for r, (status, payload) in sorted(results.items()) if status != "ok"
    ]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [torch.load(io.BytesIO(results[r][1]), weights_only=True) for r in range(world_size)]


_REFERENCE_RUNS: dict[tuple, list[Any]] = {}


def run_reference_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`run_world` for a reference run (DDP's, one process's) that several cases of a
    parametrized test compare with: run once in this pytest process, a copy of its results
    after that. Only for a run whose results depend on its arguments alone (seeded data
    and initialisation, no paths of a test's own)."""
    key = (fn.__module__, fn.__qualname__, world_size, args)
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run_world(fn, world_size, *args)
    return copy.deepcopy(_REFERENCE_RUNS[key])


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float
) -> dict[int, tuple[str, Any]]:
    ctx = mp.get_context("fork")
    phases = [ctx.Value("b", _BEFORE, lock=False) for _ in range(world_size)]
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (parent reads, rank writes)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, init_file, pipes[r][1], args, kwargs, phases[r]),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                waiting = {pipes[r][0]: r for r in range(world_size) if r not in results}
                for reader in wait(list(waiting), timeout=0.5):
                    r = waiting[reader]
                    try:
                        results[r] = reader.recv()
                    except EOFError:  # it died before it reported
                        procs[r].join(timeout=5)
                        results[r] = ("died", f"exit code {procs[r].exitcode}")
                for r, p in enumerate(procs):  # a rank killed by the runtime reports nothing
                    if r not in results and not p.is_alive() and not pipes[r][0].poll():
                        results[r] = ("died", f"exit code {p.exitcode}")
                if time.monotonic() > deadline and len(results) < world_size:
                    hung = [r for r in range(world_size) if r not in results]
                    # Read before the dump, which takes seconds (gdb): a rank may move on.
                    where = {r: phases[r].value for r in hung}
                    _dump_stacks([procs[r] for r in hung])
                    message = f"ranks {hung} did not finish within {timeout}s (hang)"
                    if _IN_FUNCTION not in where.values():
                        where = {r: _PHASE_NAMES[phase] for r, phase in where.items()}
                        raise _HarnessHang(f"{message}, outside the function: {where}")
                    _raise_on_transport_failure(results, message)
                    raise TimeoutError(message)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            for reader, _ in pipes:
                reader.close()
    return results


_PHASE_NAMES = {_BEFORE: "before its first line", _RETURNED: "after it returned"}


def _raise_on_transport_failure(results: dict[int, tuple[str, Any]], hang: str = "") -> None:
    """Raise _TransportFailure where a rank failed because gloo could not connect it."""
    for r, (status, payload) in sorted(results.items()):
        if status == "error" and _TRANSPORT_FAILURE in payload:
            first = payload.splitlines()[0][:300]
            raise _TransportFailure(f"{hang + '; ' if hang else ''}rank {r}: {first}")


def _dump_stacks(procs: list) -> None:
    """A hung rank's Python stacks (faulthandler, on SIGUSR1) and native stacks (gdb, where
    installed) to stderr, where the failure shows them: the native stack names the thread
    that a Python stack can only show as "<no Python frame>"."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1)
    gdb = shutil.which("gdb")
    for p in alive if gdb else ():
        try:
            out = subprocess.run(
                [gdb, "-p", str(p.pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out = f"gdb failed: {e}"
        print(f"native stacks of pid {p.pid}:\n{out}", file=sys.stderr)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    argv: list[str],
    world_size: int,
    timeout: float,
    env: dict[str, str] | None = None,
    grace: float = 20.0,
) -> list[tuple[int | None, str, float]]:
    """Launch `argv` as `world_size` plain processes of one gloo job (no supervisor that
    would kill the survivors of a failed rank): each rank's (exit code, output, seconds
    it ran); the exit code is None for a rank still running at `timeout`, or `grace`
    seconds after another rank ended (then killed: a stopped rank never ends)."""
    outputs = [tempfile.TemporaryFile(mode="w+") for _ in range(world_size)]  # noqa: SIM115
    port, start = free_port(), time.monotonic()
    procs = [
        subprocess.Popen(
            argv,
            env={**os.environ, **_rank_env(r, world_size, port, env)},
            stdout=outputs[r],
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world_size)
    ]
    return _watch(procs, outputs, start, timeout, grace)


def fork_processes(
    fn: Callable[..., Any], args: tuple, world_size: int, timeout: float, grace: float = 20.0
) -> list[tuple[int | None, str, float]]:
    """`run_processes` for `fn(*args)`, a function of this process: each rank a fork of it
    (what it saves: each rank's interpreter start and imports, 2-4 s of CPU) in a session
    of its own, its default gloo group made before `fn` and destroyed after. A rank exits
    0 once `fn` returns, 1 with the traceback in its output once it raises, or by the
    signal that killed it (its negative number, as a subprocess's). It leaves by
    `os._exit`, without the interpreter's shutdown (atexit hooks): a test of how a process
    exits launches a real one (`run_processes`)."""
    outputs = [tempfile.TemporaryFile(mode="w+") for _ in range(world_size)]  # noqa: SIM115
    port, start = free_port(), time.monotonic()
    procs = []
    for r in range(world_size):
        pid = os.fork()
        if pid == 0:
            _forked_rank(fn, args, _rank_env(r, world_size, port, None), outputs[r])
        procs.append(_ForkedRank(pid))
    return _watch(procs, outputs, start, timeout, grace)


def _rank_env(
    rank: int, world_size: int, port: int, extra: dict[str, str] | None
) -> dict[str, str]:
    """What a launcher sets for a rank of a plain gloo job on this machine."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **(extra or {}),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }


def _forked_rank(fn: Callable[..., Any], args: tuple, env: dict[str, str], output) -> None:
    """The body of a rank of `fork_processes`; it never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.update(env)
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


class _ForkedRank:
    """A forked rank, watched as a subprocess.Popen is: pid, poll(), wait()."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _watch(procs, outputs, start: float, timeout: float, grace: float):
    """Wait for the ranks of `run_processes` or `fork_processes` (see there)."""
    world_size = len(procs)
    ended: dict[int, float] = {}
    deadline = start + timeout
    while len(ended) < world_size and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.monotonic() - start
                deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.05)
    results = []
    for r, p in enumerate(procs):
        if p.poll() is None:  # hung, or stopped (SIGSTOP): end it
            os.killpg(p.pid, 9)
            p.wait()
        outputs[r].seek(0)
        results.append(
            (p.returncode if r in ended else None, outputs[r].read(), ended.get(r, timeout))
        )
        outputs[r].close()
    return results
