"""A rank that ends its script with the engine still alive and the default group never
destroyed; with DEAD=1, rank 1 is killed mid-step first and rank 0 catches the error.
An at-exit hook registered before the engine's (so it runs after it) reports whether
the engine's groups were closed by then."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import torch.distributed as dist  # noqa: E402

engines = []


@atexit.register
def _report() -> None:
    print(f"at exit: engine closed={engines[0].closed}", flush=True)


from training import local_batch, make_model, make_optimizer  # noqa: E402
from zero_strategy import PeerLostError, ZeroConfig, ZeroEngine  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = make_model()
engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, collective_timeout=5))
engines.append(engine)
dead = os.environ.get("DEAD") == "1"
try:
    for step in range(3):
        x, y = local_batch(step, 0, rank, world)
        loss = engine(x, y)
        if dead and step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        engine.step()
except PeerLostError as e:
    print(f"caught: {str(e)[:60]}", flush=True)
print("script done", flush=True)
