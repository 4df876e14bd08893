"""Trainer(strategy="zero3") under real launchers: Lightning's script re-run, torchrun, a
SLURM allocation (srun's environment, one process per task), and two nodes. Every one
must form the same 2-rank world and train to the same losses."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "launched_fit.py")
TIMEOUT = 240


def _free_port() -> int:
    """A free port below the kernel's ephemeral range. A port from that range (what
    bind(0) returns) can be taken as the local end of a client that connects before the
    store listens, and a client can then connect to itself: a rare hang or failure when
    ranks start together, as under SLURM."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(20_000, min(low, 32_768)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _clean_env(**extra: str) -> dict[str, str]:
    """The parent's environment without any launcher or cluster variables."""
    drop = (
        "SLURM_",
        "TORCHELASTIC_",
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NODE_RANK",
        "LOCAL_WORLD_SIZE",
        "PL_",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run_all(commands: list[tuple[list[str], dict[str, str]]], logs: Path) -> None:
    """Start every process (output to a log file each: a full pipe would block a rank and
    stall the collective), wait for all; on timeout kill their process groups."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, (cmd, env) in enumerate(commands):
        f = open(logs / f"process{i}.log", "w")  # noqa: SIM115 - closed below
        files.append(f)
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in files:
            f.close()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(
        f"--- process {i} exited {procs[i].returncode}:\n"
        + (logs / f"process{i}.log").read_text()[-4000:]
        for i in failed
    )


def _reports(out: Path, world: int) -> list[dict]:
    # Lightning's script launcher runs the other ranks as children that rank 0 does not
    # wait for at exit: on a loaded machine their reports land a moment later.
    deadline = time.monotonic() + 60
    while len(list(out.glob("rank*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.2)
    files = sorted(out.glob("rank*.json"))
    assert len(files) == world, [f.name for f in files]
    return [json.loads(f.read_text()) for f in files]


def _check_world(reports: list[dict], cluster: str) -> list[float]:
    for r in reports:
        assert r["world_size"] == r["engine_world"] == 2
        assert r["cluster"] == cluster, r
    assert sorted(r["rank"] for r in reports) == [0, 1]
    return next(r["losses"] for r in reports if r["rank"] == 0)


@pytest.fixture(scope="module")
def script_rerun_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("rerun")
    _run_all(
        [
            (
                [sys.executable, SCRIPT, str(out), "--devices", "2"],
                _clean_env(MASTER_PORT=str(_free_port())),
            )
        ],
        out / "logs",
    )
    reports = _reports(out, 2)
    assert {r["launcher"] for r in reports} == {"_SubprocessScriptLauncher"}
    return _check_world(reports, "LightningEnvironment")


def test_script_rerun_launcher(script_rerun_losses):
    assert len(script_rerun_losses) == 8  # 4 optimizer steps x 2 accumulated micro-batches


def test_torchrun_gives_the_same_losses(tmp_path, script_rerun_losses):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        SCRIPT,
        str(tmp_path),
        "--devices",
        "2",
    ]
    _run_all([(cmd, _clean_env())], tmp_path / "logs")
    losses = _check_world(_reports(tmp_path, 2), "TorchElasticEnvironment")
    assert losses == script_rerun_losses


def test_slurm_allocation_gives_the_same_losses(tmp_path, script_rerun_losses):
    """What srun sets for `--ntasks=2 --ntasks-per-node=2` on one node: one process per
    task, started by the allocation rather than by Lightning."""
    port = str(_free_port())
    commands = []
    for task in range(2):
        env = _clean_env(
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2",
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_NODEID="0",
            SLURM_NNODES="1",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="zero-test",
            SLURM_NODELIST="127.0.0.1",
            MASTER_PORT=port,
        )
        commands.append(([sys.executable, SCRIPT, str(tmp_path), "--devices", "2"], env))
    _run_all(commands, tmp_path / "logs")
    losses = _check_world(_reports(tmp_path, 2), "SLURMEnvironment")
    assert losses == script_rerun_losses


def test_two_nodes_give_the_same_losses(tmp_path, script_rerun_losses):
    """num_nodes=2 with one device each: two torchrun "nodes" on this host."""
    port = str(_free_port())
    commands = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            SCRIPT,
            str(tmp_path),
            "--devices",
            "1",
            "--num-nodes",
            "2",
        ]
        commands.append((cmd, _clean_env()))
    _run_all(commands, tmp_path / "logs")
    reports = _reports(tmp_path, 2)
    assert sorted(r["node_rank"] for r in reports) == [0, 1]
    assert all(r["local_rank"] == 0 for r in reports)
    assert _check_world(reports, "TorchElasticEnvironment") == script_rerun_losses
