"""The training loops the tests compare: single process, DDP and ZeroEngine, all on the
same model, data and hyperparameters."""

from __future__ import annotations

import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, decay_groups
from zero_strategy import ZeroConfig, ZeroEngine

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3 and 4
LR = 3e-3


def make_model(seed: int = 0, cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(decay_groups(model), lr=LR, betas=(0.9, 0.95))


def global_batch(step: int, micro: int, cfg: GPTConfig = TINY) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    data = torch.randint(cfg.vocab_size, (GLOBAL_BATCH, cfg.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def local_batch(step, micro, rank, world, cfg=TINY):
    x, y = global_batch(step, micro, cfg)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_reference(steps: int, accum: int, clip: float, seed: int = 0):
    model = make_model(seed)
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = global_batch(step, micro)
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def step_and_state(runner, optimizer, loss=None, finish: bool = False):
    """One optimizer step by the runner's spelling: torch DDP's (backward, step,
    zero_grad on the optimizer) or the engine's. With `finish` (no loss), the model's
    whole state instead: DDP's module's, or the engine's `full_state_dict()`, the engine
    closed after."""
    engine = runner if isinstance(runner, ZeroEngine) else None
    if finish:
        if engine is None:
            return {k: v.detach().clone() for k, v in runner.module.state_dict().items()}
        state = engine.full_state_dict()
        engine.close()
        return state
    if engine is None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    else:
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return None


def rel_l2(state: dict, ref: dict) -> float:
    """Relative L2 distance between two state dicts, over all their tensors."""
    num = sum(((state[k].double() - ref[k].double()) ** 2).sum() for k in ref)
    den = sum((ref[k].double() ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def accumulate(engine, step: int, rank: int, world: int, accum: int, batch=None, sync_each=False):
    """Forward and backward over step `step`'s `accum` micro-batches of this rank
    (`batch(step, micro, rank, world)`, by default `local_batch`), inside the engine's
    no_sync() for all but the last (for none with `sync_each`); this rank's summed loss."""
    batch = batch or local_batch
    total = 0.0
    for micro in range(accum):
        x, y = batch(step, micro, rank, world)
        with engine.no_sync() if micro < accum - 1 and not sync_each else torch.enable_grad():
            loss = engine(x, y) / accum
            engine.backward(loss)
        total += loss.item()
    return total


def train_ddp(rank: int, world: int, steps: int, accum: int, clip: float, seed: int = 0):
    model = torch.nn.parallel.DistributedDataParallel(make_model(seed))
    opt = make_optimizer(model.module)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = local_batch(step, micro, rank, world)
            ctx = model.no_sync() if micro < accum - 1 else torch.enable_grad()
            with ctx:
                loss = model(x, y) / accum
                loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(total))
    sd = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return losses, sd if rank == 0 else None


def train_zero(
    rank: int,
    world: int,
    steps: int,
    accum: int,
    clip: float,
    stage: int,
    seed: int = 0,
    use_no_sync: bool = True,
    placement=None,
    **config,
):
    model = make_model(seed)
    engine = ZeroEngine(
        model,
        make_optimizer(model),
        ZeroConfig(stage=stage, gradient_clipping=clip, **config),
        placement=placement,
    )
    losses = []
    for step in range(steps):
        total = accumulate(engine, step, rank, world, accum, sync_each=not use_no_sync)
        engine.step()
        engine.zero_grad()
        losses.append(_global_mean(total) if world > 1 else total)
    sd = engine.full_state_dict()
    return losses, sd if rank == 0 else None


def train_zero_resumable(
    rank: int,
    world: int,
    stage: int,
    steps: range,
    ckpt: str,
    load: bool,
    save: bool,
    seed: int = 0,
    placement=None,
    **config,
):
    """Train the given steps; optionally load `ckpt` first and/or save it after."""
    model = make_model(seed)
    engine = ZeroEngine(
        model,
        make_optimizer(model),
        ZeroConfig(stage=stage, gradient_clipping=0.5, **config),
        placement=placement,
    )
    client = engine.load_checkpoint(ckpt) if load else None
    losses = []
    for step in steps:
        total = accumulate(engine, step, rank, world, 2)
        engine.step()
        engine.zero_grad()
        losses.append(_global_mean(total) if world > 1 else total)
    if save:
        engine.save_checkpoint(
            ckpt, client_state={"next_step": steps.stop, "tag": torch.tensor([7])}
        )
    return losses, engine.full_state_dict(), client


def with_lora(model, autocast_adapter_dtype: bool = True):
    """The model with PEFT's LoRA adapters on every linear layer, B drawn at random (PEFT
    starts it at zero, which would leave A's first step without a gradient)."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=autocast_adapter_dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model
