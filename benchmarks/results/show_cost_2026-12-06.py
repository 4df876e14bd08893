# Run from the repository root: PYTHONPATH=. python benchmarks/results/show_cost_2026-12-06.py
"""Time GradFaces.show and its agreement (_given) at 82M, 2 ranks, stages 2 and 3."""
import sys, time, os
sys.path.insert(0, os.getcwd())
import torch
from tests.distributed import run_world


def body(rank, world, stage):
    torch.set_num_threads(1)
    from examples.gpt import GPT, GPTConfig
    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.model_view import grad_face
    cfg = GPTConfig(vocab_size=16384, block_size=128, n_layer=8, n_head=12, n_embd=768, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage))
    shows, givens = [], []
    real_show, real_given = grad_face.GradFaces.show, grad_face._given
    def timed_show(self):
        t = time.perf_counter(); real_show(self); shows.append(time.perf_counter() - t)
    def timed_given(sources):
        t = time.perf_counter(); out = real_given(sources); givens.append(time.perf_counter() - t); return out
    grad_face.GradFaces.show = timed_show
    grad_face._given = timed_given
    x = torch.randint(0, 16384, (4, 128), generator=torch.Generator().manual_seed(rank))
    for _ in range(6):
        loss = engine(x, x) if True else None
        loss = loss[1] if isinstance(loss, tuple) else loss
        engine.backward(loss)
        engine.step(); engine.zero_grad()
    engine.close()
    return sorted(shows)[len(shows) // 2] * 1e3, sorted(givens)[len(givens) // 2] * 1e3, len(givens)

for stage in (2, 3):
    print(stage, run_world(body, 2, stage))
