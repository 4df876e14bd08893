"""Faults a long job meets: a rank that dies or hangs mid-step, a kill at each point of a
save, a restart that resumes. Each ends in an error (never a hang) and loses nothing."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from distributed import fork_processes, run_processes, run_world
from fault_worker import run as fault_job

WORKER = str(Path(__file__).with_name("fault_worker.py"))
STARTUP = 40.0  # importing torch and building the engine, on a loaded 2-core machine


@pytest.mark.parametrize(("phase", "seed"), [("forward", 1), ("backward", 2), ("step", 3)])
def test_a_rank_killed_mid_step_ends_the_others_with_an_error_naming_the_collective(phase, seed):
    """Rank 1 is SIGKILLed at a random module's forward or backward, or in the step: rank 0
    raises PeerLostError naming the collective it was in, and exits non-zero on its own
    (no supervisor kills it), well within the collective timeout (5 s) plus start-up."""
    (rc0, out0, took0), (rc1, _, _) = fork_processes(
        fault_job, ("die", phase, "SIGKILL", str(seed)), 2, timeout=120
    )
    assert rc1 == -9
    assert rc0 == 1, out0  # an error exit: not a hang (None), not an abort (-6)
    assert "PeerLostError: A peer stopped answering during " in out0
    assert "on the engine's group of ranks [0, 1] (this is rank 0; the peers are [1])" in out0
    assert "Restart the job from the last checkpoint" in out0
    assert took0 < STARTUP + 5 + 10, took0


def test_a_rank_that_hangs_ends_the_others_within_the_collective_timeout():
    """A stopped (SIGSTOP) rank holds its sockets open: the survivor raises once the
    engine's collective timeout (5 s) runs out, naming the collective."""
    (rc0, out0, took0), _ = fork_processes(  # the stopped rank never ends: no grace for it
        fault_job, ("die", "backward", "SIGSTOP", "4"), 2, timeout=120, grace=1
    )
    assert rc0 == 1, out0
    assert "PeerLostError: A peer stopped answering during " in out0
    # gloo says "Timed out waiting 5000ms for recv ..." or "Application timeout caused
    # pair closure", depending on where the wait was
    assert "Timed out waiting" in out0 or "Application timeout" in out0, out0
    assert took0 < STARTUP + 5 + 10, took0


SAVE_POINTS = [
    ("before_shards", 1, 1),
    ("mid_shard", 1, 1),
    ("mid_shard", 0, 1),
    ("after_shards", 1, 1),
    ("after_index", 0, 1),
    ("between_renames", 0, 1),
    ("after_swap", 0, 2),
]


@pytest.mark.parametrize(("point", "victim", "survives"), SAVE_POINTS)
def test_a_kill_at_any_point_of_a_save_leaves_a_whole_checkpoint(point, victim, survives, tmp_path):
    """A rank is SIGKILLed at each point of a save over a whole checkpoint (step 1). The
    checkpoint at the path still loads, and is the previous one (step 1) unless the kill
    came after the new one was in place (step 2); a half-written directory is refused;
    the other rank ends with an error, and the next save clears what the kill left."""
    import warnings

    from training import make_model, make_optimizer
    from zero_strategy import CheckpointError, ZeroConfig, ZeroEngine

    ckpt = tmp_path / "ckpt"
    results = fork_processes(fault_job, ("save", str(ckpt), point, str(victim)), 2, timeout=120)
    assert results[victim][0] == -9, results[victim][1]
    rc, out, _ = results[1 - victim]
    assert rc not in (0, None), out  # ended with an error, on its own
    assert "PeerLostError" in out or "CheckpointError" in out, out

    model = make_model(seed=5)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = engine.load_checkpoint(ckpt)
    assert client == {"step": survives}
    assert any("interrupted" in str(w.message) for w in caught) == (point == "between_renames")
    staging = tmp_path / "ckpt.tmp"
    if staging.exists() and not (staging / "index.json").exists():
        with pytest.raises(CheckpointError, match="not a complete zero-strategy checkpoint"):
            engine.load_checkpoint(staging)

    engine.save_checkpoint(ckpt)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert engine.load_checkpoint(ckpt) is None  # the new save, without client state


def _torchrun(script: str, *args: str, restarts: int, share: str = "1", timeout: float = 200):
    import subprocess

    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["--max-restarts", str(restarts), script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=share)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def test_torchrun_restarts_a_killed_engine_job_and_it_ends_with_the_same_losses(tmp_path):
    """Rank 1 is killed in the backward of step 3 (a checkpoint was saved after step 2);
    torchrun --max-restarts 1 restarts both ranks, which resume from the checkpoint and
    finish with the losses of an uninterrupted run (two ranks forked here), step for
    step."""
    steps = "6"
    plain = ("resume", str(tmp_path / "a"), str(tmp_path / "a.json"), steps, "-1")
    for code, out, _ in fork_processes(fault_job, plain, 2, timeout=200):
        assert code == 0, out[-3000:]
    hit = _torchrun(
        WORKER, "resume", str(tmp_path / "b"), str(tmp_path / "b.json"), steps, "3", restarts=1
    )
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in hit.stderr  # the first attempt lost rank 1
    expected = json.loads((tmp_path / "a.json").read_text())
    assert list(expected) == [str(s) for s in range(6)]
    assert json.loads((tmp_path / "b.json").read_text()) == expected


def test_lightning_resumes_from_last_ckpt_after_a_kill_during_its_save(tmp_path):
    """Lightning saves last.ckpt after every step; rank 1 is killed halfway through its
    shard of the save after step 3. last.ckpt is still the whole step-2 checkpoint, the
    torchrun restart resumes from it with fit(ckpt_path="last"), and the losses equal
    an uninterrupted run's."""
    pytest.importorskip("lightning")
    from fault_lightning import main as lightning_job

    script = str(Path(__file__).with_name("fault_lightning.py"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for code, out, _ in fork_processes(lightning_job, (str(tmp_path / "a"), "6", "-1"), 2, 200):
        assert code == 0, out[-3000:]  # uninterrupted, in two ranks forked here
    hit = _torchrun(script, str(tmp_path / "b"), "6", "3", restarts=1)
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in hit.stderr
    expected = json.loads((tmp_path / "a" / "losses.json").read_text())
    assert list(expected) == [str(s) for s in range(6)]
    assert json.loads((tmp_path / "b" / "losses.json").read_text()) == expected
    assert sorted(os.listdir(tmp_path / "b")) == ["last.ckpt", "losses.json"]


def test_restarts_over_torchruns_shared_store_are_named_with_the_fix(monkeypatch):
    """torchrun (torch >= 2.5) shares its rendezvous store across restarts; a restarted
    attempt's group creation can then read a dead attempt's address. The engine warns
    when it runs so, and a failed group creation in a restart names the cause and fix."""
    from zero_strategy.comm import elastic_store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic_store.warn_if_restarts_share_a_store()
    refused = RuntimeError("Gloo connectFullMesh failed with ... Connection refused")
    explained = elastic_store.explain_group_failure(refused)
    assert "torchrun's restart 1" in str(explained)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(explained)
    other = RuntimeError("output tensor must have the same size")
    assert elastic_store.explain_group_failure(other) is other
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the fix applied
    assert elastic_store.explain_group_failure(refused) is refused


@pytest.mark.parametrize("dead_peer", [False, True])
def test_an_engine_alive_at_exit_is_closed_and_the_process_exits_cleanly(dead_peer):
    """A script that never closes its engine nor destroys the default group: the engine
    is closed at exit (work finished, groups destroyed) and the ranks exit with status 0.
    With the peer killed mid-step (rank 0 catches the PeerLostError), the exit is not
    held up by the dead peer."""
    script = str(Path(__file__).with_name("exit_worker.py"))
    env = {"DEAD": "1" if dead_peer else "0"}
    results = run_processes([sys.executable, script], 2, timeout=120, env=env)
    rc0, out0, took0 = results[0]
    assert rc0 == 0, out0
    assert "at exit: engine closed=True" in out0
    assert ("caught: A peer stopped answering" in out0) == dead_peer
    assert took0 < STARTUP + 5 + 10
    if not dead_peer:
        assert results[1][0] == 0, results[1][1]
        assert "at exit: engine closed=True" in results[1][1]


def test_the_engine_as_a_context_manager_closes_its_groups():
    results = run_world(_context_managed, 2)
    assert results == [(False, True, False)] * 2


def _context_managed(rank, world):
    from training import local_batch, make_model, make_optimizer
    from zero_strategy import ZeroConfig, ZeroEngine

    model = make_model()
    with ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3)) as engine:
        x, y = local_batch(0, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        inside = engine.closed
    closed = engine.closed
    engine.backward(engine(x, y))  # used again: every rank re-creates the groups
    engine.step()
    return inside, closed, engine.closed


def _save_failing_on_rank_1(rank, world, ckpt):
    from safetensors import SafetensorError

    from training import local_batch, make_model, make_optimizer
    from zero_strategy import CheckpointError, ZeroConfig, ZeroEngine
    from zero_strategy.checkpoint import save_agreement

    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, collective_timeout=60))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(ckpt, client_state={"step": 1})
    if rank == 1:

        def full(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")

        save_agreement.save_file = full
    start = time.monotonic()
    try:
        engine.save_checkpoint(ckpt, client_state={"step": 2})
    except CheckpointError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_at_once(tmp_path):
    """Rank 1's disk is full; rank 0's write succeeds. Both raise the same error (rank
    1's) right away, instead of rank 0 waiting out the collective timeout (60 s here) in
    the save's next collective; the previous checkpoint loads."""
    from training import make_model, make_optimizer
    from zero_strategy import ZeroConfig, ZeroEngine

    ckpt = str(tmp_path / "ckpt")
    for message, took in run_world(_save_failing_on_rank_1, 2, ckpt, timeout=120):
        assert message is not None and "rank 1: writing" in message
        assert "no space left on the device of" in message
        assert took < 30, took
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    assert engine.load_checkpoint(ckpt) == {"step": 1}


def _load_corrupt_on_rank_1(rank, world, ckpt):
    import torch

    from training import make_model, make_optimizer
    from zero_strategy import CheckpointError, ZeroConfig, ZeroEngine

    model = make_model(seed=3)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, collective_timeout=60))
    before = [unit.master.clone() for unit in engine.units]
    start = time.monotonic()
    try:
        engine.load_checkpoint(ckpt)
        message = None
    except CheckpointError as e:
        message = str(e)
    unchanged = all(torch.equal(a, unit.master) for a, unit in zip(before, engine.units))
    return message, time.monotonic() - start, unchanged


def test_a_shard_only_one_rank_reads_is_refused_on_every_rank(tmp_path):
    """A flipped byte in rank00001's file, which only rank 1 reads when the world and
    stage are the same: every rank refuses the checkpoint (rank 0 names rank 1's
    finding) and no rank changed its model."""
    from training import train_zero_resumable

    ckpt = str(tmp_path / "ckpt")
    run_world(train_zero_resumable, 2, 3, range(1), ckpt, False, True)
    shard = Path(ckpt, "rank00001.safetensors")
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    results = run_world(_load_corrupt_on_rank_1, 2, ckpt, timeout=120)
    (m0, took0, same0), (m1, took1, same1) = results
    assert m1 is not None and "rank00001.safetensors" in m1 and "fails its checksum" in m1
    assert m0 is not None and m0.startswith("rank 1: ") and "fails its checksum" in m0
    assert same0 and same1
    assert took0 < 30 and took1 < 30
