"""What the stage 2-3 agreement on unused parameters costs inside a step.

After each synchronised backward at stages 2-3 the ranks of each shard group agree, with
one control all-reduce of a flag per trainable parameter, which parameters no rank gave a
gradient (their `.grad` then reads None, as under DDP). This times `GradFaces.show` (the
faces put on `.grad`) and the agreement inside it, per step, in the 82M bench GPT on two
gloo ranks, at stages 2 and 3: the median over the steps, on each rank.

    PYTHONPATH=. python benchmarks/unused_grads_cost.py --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.distributed import run_world


def _timed(record: list[float], fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out

    return wrapper


def _run(rank: int, world: int, stage: int, steps: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    from examples.gpt import GPT, GPTConfig
    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.model_view import grad_face

    cfg = GPTConfig(
        vocab_size=16384, block_size=128, n_layer=8, n_head=12, n_embd=768, tie_embeddings=False
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage))
    shows: list[float] = []
    agreements: list[float] = []
    grad_face.GradFaces.show = _timed(shows, grad_face.GradFaces.show)
    grad_face._given = _timed(agreements, grad_face._given)
    tokens = torch.randint(
        0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(rank)
    )
    for _ in range(steps):
        out = engine(tokens, tokens)
        engine.backward(out[1] if isinstance(out, tuple) else out)
        engine.step()
        engine.zero_grad()
    engine.close()
    return statistics.median(shows) * 1e3, statistics.median(agreements) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print("| stage | faces shown, rank 0 / rank 1 (ms) | of which the agreement (ms) |")
    print("|---|---|---|")
    for stage in (2, 3):
        (show0, agree0), (show1, agree1) = run_world(_run, 2, stage, args.steps)
        print(f"| {stage} | {show0:.1f} / {show1:.1f} | {agree0:.1f} / {agree1:.1f} |")


if __name__ == "__main__":
    main()
