"""One rank of a job that meets a fault: the tests fork it (`run`) or launch it under
torchrun, and check how each rank ends.

    die PHASE SIGNAL SEED      rank 1 sends itself SIGNAL at a random module's forward or
                               backward (picked by SEED), or in the optimizer step
    save CKPT POINT VICTIM     save CKPT whole, then save it again with rank VICTIM killed
                               at POINT of the save
    resume CKPT OUT STEPS KILL train STEPS steps, saving CKPT after each; on torchrun's
                               first attempt rank 1 is killed in step KILL's backward; a
                               restart resumes from CKPT. Rank 0 writes {step: loss} to OUT.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from training import TINY, local_batch, make_model, make_optimizer  # noqa: E402
from zero_strategy import ZeroConfig, ZeroEngine  # noqa: E402
from zero_strategy.checkpoint import atomic_dir, save_agreement  # noqa: E402


def _kill(sig: signal.Signals = signal.SIGKILL) -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), sig)


def _engine(timeout: float = 30.0) -> ZeroEngine:
    model = make_model()
    cfg = ZeroConfig(stage=3, gradient_clipping=0.5, collective_timeout=timeout)
    return ZeroEngine(model, make_optimizer(model), cfg)


def _train_step(engine: ZeroEngine, step: int, rank: int, world: int) -> float:
    """One step; the global mean loss (a collective of the caller's own)."""
    loss = _engine_step(engine, step, rank, world)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _engine_step(engine: ZeroEngine, step: int, rank: int, world: int):
    x, y = local_batch(step, 0, rank, world)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss


def die(phase: str, sig_name: str, seed: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine(timeout=5.0)
    sig = getattr(signal, sig_name)
    modules = [m for m in engine.module.modules() if any(p.requires_grad for p in m.parameters())]
    victim = random.Random(int(seed)).choice(modules)
    armed = {"on": False}

    def fire(*_):
        if armed["on"] and rank == 1:
            _kill(sig)

    if phase == "forward":
        victim.register_forward_pre_hook(fire)
    elif phase == "backward":
        victim.register_full_backward_pre_hook(fire)
    else:
        engine.optimizer.register_step_pre_hook(fire)
    for step in range(4):
        armed["on"] = step == 2
        _engine_step(engine, step, rank, world)  # only the engine's collectives
    print("finished", flush=True)


def save(ckpt: str, point: str, victim: str) -> None:
    """Points of a save: before any shard is written, halfway through this rank's shard,
    after it, after the index (rank 0), between the two renames of a publish without
    the atomic swap (rank 0), and after the swap before the old directory is removed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine()
    _train_step(engine, 0, rank, world)
    engine.save_checkpoint(ckpt, client_state={"step": 1})
    _train_step(engine, 1, rank, world)
    mine = rank == int(victim)
    real_save_file, real_rename = save_agreement.save_file, Path.rename

    def save_file(tensors, target):
        if mine and point == "before_shards":
            _kill()
        real_save_file(tensors, target)
        if mine and point == "mid_shard":
            data = Path(target).read_bytes()
            Path(target).write_bytes(data[: len(data) // 2])
            _kill()
        if mine and point == "after_shards":
            _kill()

    def publish(tmp, final, swap=True):
        if mine and point == "after_index":
            _kill()
        return real_publish(tmp, final, swap=point != "between_renames")

    def rename(self, target):
        if mine and point == "between_renames" and self.name.endswith(".tmp"):
            _kill()  # the old directory was renamed away; the new one not yet in place
        return real_rename(self, target)

    def fsync_dir(path):
        if mine and point == "after_swap" and Path(path) == Path(ckpt).parent:
            _kill()
        real_fsync_dir(path)

    real_publish, real_fsync_dir = atomic_dir.publish, atomic_dir.fsync_dir
    save_agreement.save_file = save_file
    atomic_dir.publish = publish
    atomic_dir.fsync_dir = fsync_dir
    Path.rename = rename
    engine.save_checkpoint(ckpt, client_state={"step": 2})
    print("finished", flush=True)


def resume(ckpt: str, out: str, steps: str, kill: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    start = 0
    if Path(ckpt).exists():
        start = engine.load_checkpoint(ckpt)["next_step"]
    losses = json.loads(Path(out).read_text()) if rank == 0 and Path(out).exists() else {}
    for step in range(start, int(steps)):
        if first_attempt and rank == 1 and step == int(kill):
            engine.module.blocks[0].register_full_backward_pre_hook(lambda *_: _kill())
        losses[str(step)] = _train_step(engine, step, rank, world)
        engine.save_checkpoint(ckpt, client_state={"next_step": step + 1})
        if rank == 0:
            Path(out).write_text(json.dumps(losses))
    print("finished", flush=True)


def run(mode: str, *args: str) -> None:
    """The job's body, in a process whose default group is made (the tests fork it from
    theirs, or launch this script)."""
    assert TINY.n_layer >= 1
    {"die": die, "save": save, "resume": resume}[mode](*args)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        run(*sys.argv[1:])
    finally:
        dist.destroy_process_group()
