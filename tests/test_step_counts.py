"""Each parameter keeps its own step count, as torch's optimizers count it.

LayerDrop drawn alike on every rank (one seed: Transformers' wav2vec2 and HuBERT draw so)
leaves a dropped block without a gradient on any rank. One process skips it, step count
and all, and its next step's bias correction uses its own count. The engine steps a
rank's slice of many parameters with one count, so it keeps each parameter's lag and
steps a lagging one again with its own (`optim/step_lag.py`).

Checked against torch's AdamW on the union of the ranks' batches, step by step: the
weights at every stage (in memory, and with the optimizer state and gradient shards on
disk); the whole optimizer state (each parameter's count, none for one never stepped);
a save resumed at another world size and stage; and a one-process optimizer state, with
its per-parameter counts, resumed by the engine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine

DIM, BLOCKS, STEPS = 12, 4, 8
LAST_JOINS = 4  # the last block is dropped on every step before this one


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(BLOCKS)])
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, dropped: set[int]) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i not in dropped:
                x = torch.tanh(block(x))
        return self.head(x).pow(2).mean()


def _dropped(step: int) -> set[int]:
    """The blocks every rank drops on `step` (one draw for all ranks)."""
    g = torch.Generator().manual_seed(step)
    drawn = {i for i in range(BLOCKS) if torch.rand((), generator=g) < 0.4}
    return drawn | ({BLOCKS - 1} if step < LAST_JOINS else set())


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _halve(optimizer, args, kwargs) -> None:
    """A step pre-hook that changes the gradients it is shown."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


def _reference(world: int, steps: int = STEPS, make_optimizer=None, hook=None):
    """torch's AdamW (or `make_optimizer`'s) on one process: the weights after each step,
    and the optimizer's state after `LAST_JOINS - 1` steps and after all."""
    torch.manual_seed(0)
    model = Stack()
    optimizer = (make_optimizer or _adamw)(model.parameters())
    if hook is not None:
        optimizer.register_step_pre_hook(hook)
    weights, states = [], {}
    for step in range(steps):
        for rank in range(world):
            (model(_batch(step, rank), _dropped(step)) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if step + 1 in (LAST_JOINS - 1, steps):
            live = optimizer.state_dict()["state"]  # torch's own tensors, stepped in place
            states[step + 1] = {i: {k: v.clone() for k, v in s.items()} for i, s in live.items()}
    return weights, states


def _engine(stage: int, seed: int = 0, make_optimizer=None, hook=None, **config) -> ZeroEngine:
    torch.manual_seed(seed)
    model = Stack()
    optimizer = (make_optimizer or _adamw)(model.parameters())
    if hook is not None:
        optimizer.register_step_pre_hook(hook)
    config = ZeroConfig(stage, collective_timeout=30.0, **config)
    return ZeroEngine(model, optimizer, config)


def _one_step(engine: ZeroEngine, x: torch.Tensor, step: int) -> None:
    engine.backward(engine(x, _dropped(step)))
    engine.step()
    engine.zero_grad()


def _closed(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The engine's weights, whole, and the engine closed."""
    state = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return state


def _train(rank: int, world: int, stage: int, steps: int = STEPS, **config):
    engine = _engine(stage, **config)
    lags = engine.optim.step_lags
    weights, states = [], {}
    for step in range(steps):
        _one_step(engine, _batch(step, rank), step)
        weights.append({k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()})
        if step + 1 in (LAST_JOINS - 1, steps):
            states[step + 1] = engine.full_optimizer_state_dict(rank0_only=False)["state"]
    states["lags"] = dict(lags.lags)
    engine.close()
    return weights, states


def _assert_states_equal(got: dict[int, dict], want: dict[int, dict]) -> None:
    """Two optimizer states keyed by parameter position, as torch keys them."""
    assert sorted(got) == sorted(want)  # no entry where torch has none
    for i, state in want.items():
        assert float(got[i]["step"]) == float(state["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[i][key], state[key], rtol=1e-6, atol=1e-8)


def test_the_drops_leave_parameters_with_different_counts():
    """The schedule is one that tells the counts apart: torch's per-parameter counts
    differ at the end, and the last block has none before it joins."""
    _, states = _reference(2)
    early, late = states[LAST_JOINS - 1], states[STEPS]
    last_block = 2 * (BLOCKS - 1)  # its weight's position
    assert last_block not in early and last_block in late
    counts = {float(s["step"]) for s in late.values()}
    assert len(counts) >= 3, counts


@pytest.mark.parametrize(
    "stage,offload",
    [(0, None), (1, None), (2, None), (3, None), (3, "disk")],
)
def test_each_parameter_steps_with_its_own_count(stage, offload, tmp_path):
    config = {}
    if offload:
        config = {"offload_optimizer": offload, "offload_dir": str(tmp_path)}
        config |= {"offload_tile_size": 200, "offload_buffer_count": 2}
    weights, states = _reference(2)
    for got_weights, got_states in run_world(_train, 2, stage, timeout=120, **config):
        for step, (got, want) in enumerate(zip(got_weights, weights)):
            for key, value in want.items():
                torch.testing.assert_close(
                    got[key], value, rtol=1e-6, atol=1e-7, msg=f"step {step} {key}"
                )
        for at, want in states.items():
            _assert_states_equal(got_states[at], want)
        assert got_states["lags"]  # the schedule leaves blocks behind


def _resumed(rank: int, world: int, stage: int, path: str, save: bool) -> dict:
    """The first half at 2 ranks and stage 3, saved; or the second half, loaded."""
    engine = _engine(stage, seed=0 if save else 1)  # the load must bring every value
    steps = range(STEPS // 2) if save else range(STEPS // 2, STEPS)
    if not save:
        engine.load_checkpoint(path)
    for step in steps:
        if save:
            x = _batch(step, rank)
        else:  # the union of the two saving ranks' batches, on this world's ranks
            x = torch.cat([_batch(step, r) for r in range(2)]).chunk(world)[rank]
        _one_step(engine, x, step)
    if save:
        engine.save_checkpoint(path)
    return _closed(engine)


def test_the_counts_survive_a_save_resumed_at_another_world_size_and_stage(tmp_path):
    """Saved at 2 ranks and stage 3 after 4 steps (the last block 4 steps behind, others
    1-2), resumed by one process at stage 1: the next 4 steps are torch's."""
    weights, _ = _reference(2)
    path = str(tmp_path / "ckpt")
    run_world(_resumed, 2, 3, path, True, timeout=120)
    (got,) = run_world(_resumed, 1, 1, path, False, timeout=120)
    for key, value in weights[-1].items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


def _from_one_process(rank: int, world: int, stage: int, path: str) -> dict:
    engine = _engine(stage, seed=1)
    engine.load_checkpoint(path)
    for step in range(LAST_JOINS - 1, STEPS):
        _one_step(engine, _batch(step, rank), step)
    return _closed(engine)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_one_process_optimizer_state_resumes_with_its_counts(stage, tmp_path):
    """torch's AdamW state after 3 steps, keyed by position as DDP and a plain run save it:
    its parameters' counts differ, and the last block has no state at all. Resumed by the
    engine on 2 ranks, the remaining steps are torch's."""
    torch.manual_seed(0)
    model = Stack()
    optimizer = _adamw(model.parameters())
    for step in range(LAST_JOINS - 1):
        for rank in range(2):
            (model(_batch(step, rank), _dropped(step)) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path / "one.pt"
    torch.save(
        {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, path
    )
    weights, _ = _reference(2)
    for got in run_world(_from_one_process, 2, stage, str(path), timeout=120):
        for key, value in weights[-1].items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


def _own_state_dicts(rank: int, world: int, stage: int, path: str) -> dict:
    """Each rank's `optimizer.state_dict()` after 4 steps (the DDP habit), and the weights
    in a checkpoint; a fresh engine takes the weights alone and each rank its own state
    dict back, and the last 4 steps follow."""
    import io

    engine = _engine(stage)
    for step in range(STEPS // 2):
        _one_step(engine, _batch(step, rank), step)
    own = io.BytesIO()
    torch.save(engine.optimizer.state_dict(), own)
    engine.save_checkpoint(path)
    engine.close()
    engine = _engine(stage, seed=1)
    engine.load_checkpoint(path, load_optimizer_states=False)
    engine.optimizer.load_state_dict(torch.load(io.BytesIO(own.getvalue()), weights_only=True))
    for step in range(STEPS // 2, STEPS):
        _one_step(engine, _batch(step, rank), step)
    return _closed(engine)


@pytest.mark.parametrize("stage", [1, 3])
def test_each_ranks_own_optimizer_state_dict_keeps_the_counts(stage, tmp_path):
    """The flat shards hold one count per slice: the lags travel in the state dict's mark."""
    weights, _ = _reference(2)
    for got in run_world(_own_state_dicts, 2, stage, str(tmp_path / "ckpt"), timeout=120):
        for key, value in weights[-1].items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_a_step_hook_changes_every_gradient_of_a_step_taken_by_parts():
    """A step pre-hook sees and changes the gradients of the slices stepped by parts too
    (it runs around the whole step, as with the state offloaded), as around torch's."""
    weights, _ = _reference(2, hook=_halve)
    for got_weights, _ in run_world(_train, 2, 2, hook=_halve, timeout=120):
        for key, value in weights[-1].items():
            torch.testing.assert_close(got_weights[-1][key], value, rtol=1e-6, atol=1e-7)


def _nadam(params) -> torch.optim.NAdam:
    return torch.optim.NAdam(params, lr=0.05)


def _held_back_reference(make_optimizer, world: int = 2) -> list[dict[str, torch.Tensor]]:
    """One process whose optimizer steps every parameter on every step (a zero gradient
    where none came), then puts back the values and moments of those that got none:
    counts and other scalars advance for all, as they do for a whole slice."""
    torch.manual_seed(0)
    model = Stack()
    optimizer = make_optimizer(model.parameters())
    weights = []
    for step in range(STEPS):
        for rank in range(world):
            (model(_batch(step, rank), _dropped(step)) / world).backward()
        skipped = [p for p in model.parameters() if p.grad is None]
        kept = [(p, p.detach().clone(), _moments(optimizer, p)) for p in skipped]
        for p in skipped:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, value, moments in kept:
                p.copy_(value)
                for key, before in moments.items():
                    optimizer.state[p][key].copy_(before)
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return weights


def _moments(optimizer, p) -> dict[str, torch.Tensor]:
    """A parameter's state tensors shaped as it: zeros before its first step makes them."""
    if p not in optimizer.state:
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    state = optimizer.state[p]
    return {k: v.clone() for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape}


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_with_another_per_parameter_scalar_steps_by_slices(stage):
    """NAdam keeps `mu_product` beside its count: the slice's, which stepping by parts
    would multiply once per part. Such an optimizer steps whole slices and keeps no lags
    (the documented limit): a parameter with no gradient is put back, and its count and
    `mu_product` advance with its slice's, step by step as in a process that does so."""
    weights = _held_back_reference(_nadam)
    for got_weights, got_states in run_world(_train, 2, stage, make_optimizer=_nadam):
        assert got_states["lags"] == {}
        for step, (got, want) in enumerate(zip(got_weights, weights)):
            for key, value in want.items():
                torch.testing.assert_close(
                    got[key], value, rtol=1e-6, atol=1e-7, msg=f"step {step} {key}"
                )


def _edited_mark(rank: int, world: int) -> str:
    engine = _engine(2)
    for step in range(2):
        _one_step(engine, _batch(step, rank), step)
    state_dict = engine.optimizer.state_dict()
    state_dict["zero_strategy_shards"]["step_lags"] = [[7, 0, 0, 1]]  # no such group
    try:
        engine.optimizer.load_state_dict(state_dict)
    except ValueError as e:
        return str(e)
    finally:
        engine.close()
    return "loaded"


def test_a_state_dict_whose_lags_were_edited_is_refused_before_the_load():
    (message,) = run_world(_edited_mark, 1)
    assert "'step_lags' is not a list of [param group, unit, slot, lag]" in message
