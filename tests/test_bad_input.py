"""Every rejected input gets an error that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_world
from training import make_model, make_optimizer, step_and_state
from zero_strategy import (
    CheckpointError,
    UnsupportedOptimizerError,
    ZeroConfig,
    ZeroConfigError,
    ZeroEngine,
)

BAD_VALUES = [
    ("stage", 4, "use 0 (replicated)"),
    ("stage", True, "use 0 (replicated)"),
    ("bucket_size", 0, "positive number of elements"),
    ("bucket_size", 2.5, "positive number of elements"),
    ("prefetch_depth", -1, "non-negative integer"),
    ("persistence_threshold", -5, "non-negative integer"),
    ("max_reuse_distance", -1, "non-negative integer"),
    ("overlap_comm", "yes", "True or False"),
    ("verify_module_order", 1, "True or False"),
    ("unit_module_classes", "Block", "list of module class names"),
    ("fp32_parameters", "router", "list of regular expressions"),
    ("fp32_parameters", ["gate("], "list of regular expressions"),
    ("compute_dtype", "fp8", "'fp32', 'bf16', 'fp16'"),
    ("reduce_dtype", "int8", "'fp32', 'bf16', 'fp16'"),
    ("loss_scale", "auto", "'dynamic' or a finite positive number"),
    ("loss_scale", -1, "'dynamic' or a finite positive number"),
    ("initial_loss_scale_power", 100, "between 0 and 64"),
    ("loss_scale_window", 0, "positive number of steps"),
    ("min_loss_scale", 0, "positive number"),
    ("gradient_clipping", -1.0, "0 (off) or a positive max norm"),
    ("gradient_clipping", float("nan"), "0 (off) or a positive max norm"),
    ("collective_timeout", 0, "positive number of seconds"),
    ("reduce_scatter_via_all_reduce", "auto", "None (automatic), True or False"),
    ("all_gather_via_broadcast", 1, "None (automatic), True or False"),
    ("overlap_param_gather", None, "True or False"),
    ("allow_untested_optimizer", "no", "True or False"),
    ("expert_parallel_size", 0, "positive number of ranks"),
]


@pytest.mark.parametrize(("name", "value", "fix"), BAD_VALUES)
def test_each_invalid_config_value_names_field_and_fix(name, value, fix):
    with pytest.raises(ZeroConfigError) as err:
        ZeroConfig(**{name: value})
    assert f"ZeroConfig.{name}=" in str(err.value)
    assert fix in str(err.value)


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(
        ZeroConfigError, match=r"Unknown ZeroConfig option.*'stages'.*known options.*'stage'"
    ):
        ZeroConfig.from_dict({"stages": 3})


def test_engine_accepts_a_dict_config_and_rejects_other_types():
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), {"stage": 2})
    assert engine.config.stage == 2
    with pytest.raises(TypeError, match="ZeroConfig or a dict"):
        ZeroEngine(make_model(), make_optimizer(make_model()), "zero3")


def test_lbfgs_is_refused():
    model = make_model()
    with pytest.raises(UnsupportedOptimizerError, match=r"LBFGS is not supported.*AdamW"):
        ZeroEngine(model, torch.optim.LBFGS(model.parameters()))


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.sign(), alpha=-group["lr"])


def test_unknown_optimizer_is_refused_unless_opted_in():
    model = make_model()
    with pytest.raises(UnsupportedOptimizerError, match="allow_untested_optimizer=True"):
        ZeroEngine(model, Lion(model.parameters()))
    engine = ZeroEngine(model, Lion(model.parameters()), ZeroConfig(allow_untested_optimizer=True))
    assert type(engine.optimizer) is Lion


def test_optimizer_over_another_models_params_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match=r"not parameters of the model.*model.parameters"):
        ZeroEngine(model, make_optimizer(make_model()))


def test_a_position_keyed_optimizer_state_with_other_groups_is_refused_naming_the_fix(tmp_path):
    model = nn.Linear(4, 2)
    written_with = torch.optim.SGD(
        [{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1, momentum=0.9
    )
    model(torch.ones(1, 4)).sum().backward()
    written_with.step()
    path = tmp_path / "plain.ckpt"
    torch.save(
        {"state_dict": model.state_dict(), "optimizer_states": [written_with.state_dict()]}, path
    )
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(
        CheckpointError,
        match=r"keyed by position.*group 0 has 1 parameters where the engine's optimizer has 2.*same param groups",
    ):
        engine.load_checkpoint(path)
    engine.load_checkpoint(path, load_optimizer_states=False)  # the weights alone load


def test_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match="has no parameters"):
        ZeroEngine(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))


def test_frozen_model_is_refused():
    model = make_model()
    opt = make_optimizer(model)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="No parameter of the model is both trainable"):
        ZeroEngine(model, opt)


def _tiny(rank, world, stage):
    """One weight on two ranks: one rank's shard is padding alone."""
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if stage is None:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        model = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    for _ in range(3):
        step_and_state(model, optimizer, model(torch.full((2, 1), float(rank + 1))).pow(2).mean())
    module = model.module
    with model.gathered_parameters() if stage is not None else torch.no_grad():
        return module.weight.item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_smaller_than_the_world_trains_as_ddp(stage):
    """Fewer elements than ranks (Lightning's spike-detection test model has one): the
    ranks owning only padding step nothing and everyone ends where DDP does."""
    ddp = run_world(_tiny, 2, None)
    assert run_world(_tiny, 2, stage) == pytest.approx(ddp, rel=1e-6)


def _different_models(rank, world):
    model = nn.Linear(4, 4 + rank)
    ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2))


def test_different_models_on_different_ranks_are_refused():
    for status, message in run_world(_different_models, 2, expect_errors=True):
        assert status == "error"
        assert "differ across ranks" in message


def test_direct_optimizer_step_is_refused():
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=1))
    x = torch.randint(64, (2, 9))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    with pytest.raises(RuntimeError, match=r"Call engine\.step"):
        engine.optimizer.step()
    assert engine.step()


def _step_after_no_sync_only(rank, world, stage):
    """A backward inside no_sync(), a step (refused at stages 1-3), a synchronised
    backward, a step: the weights after each step, or the first step's error."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(rank))
    if stage is None:
        forward, step = nn.parallel.DistributedDataParallel(model), opt.step
    else:
        forward = ZeroEngine(model, [opt], ZeroConfig(stage=stage))
        step = forward.step
    weights, refusal = [], None
    with forward.no_sync():
        forward(xs[0]).sum().backward()
    try:
        step()
    except RuntimeError as e:
        refusal = str(e)
    if stage is not None:
        forward.wait_for_parameters()
    weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    forward(xs[1]).sum().backward()
    step()
    if stage is not None:
        forward.wait_for_parameters()
    weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    if stage is not None:
        forward.close()
    return refusal, weights


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_over_gradients_no_sync_left_unreduced_is_refused_naming_the_fix(stage):
    """Under DDP such a step takes each rank's own sums and the replicas drift apart; a
    sharded step has no such meaning (stage 1 mixed the ranks' sums shard by shard,
    stages 2-3 stepped nothing). Stages 1-3 refuse it and keep the sums: the next
    synchronised backward reduces both micro-batches, as DDP's accumulation does. Stage
    0 steps as DDP."""
    ours = run_world(_step_after_no_sync_only, 2, stage)
    if stage == 0:
        ddp = run_world(_step_after_no_sync_only, 2, None)
        for (refusal, weights), (_, ddp_weights) in zip(ours, ddp):
            assert refusal is None
            for name, value in ddp_weights[1].items():
                torch.testing.assert_close(weights[1][name], value)
        return
    torch.manual_seed(0)
    start = dict(nn.Linear(4, 3).named_parameters())
    accumulated = run_world(_accumulate_then_step, 2)  # one step over both micro-batches
    for (refusal, weights), expected in zip(ours, accumulated):
        assert refusal is not None
        assert "inside no_sync()" in refusal and "outside no_sync()" in refusal
        for name, p in start.items():
            assert torch.equal(weights[0][name], p.detach())  # nothing stepped
        for name, value in expected.items():
            torch.testing.assert_close(weights[1][name], value)


def _accumulate_then_step(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(rank))
    ddp = nn.parallel.DistributedDataParallel(model)
    with ddp.no_sync():
        ddp(xs[0]).sum().backward()
    ddp(xs[1]).sum().backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_unit_module_classes_must_exist():
    model = make_model()
    with pytest.raises(ValueError, match=r"names \['Blok'\].*module classes are.*'Block'"):
        ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, unit_module_classes=["Blok"]))


def test_meta_module_without_initialiser_is_refused():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        model = Raw()
    with pytest.raises(ValueError, match=r"has no reset_parameters.*param_init_fn"):
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.device("meta"):
        model = Raw()
    engine = ZeroEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        param_init_fn=lambda m: nn.init.ones_(m.w) if isinstance(m, Raw) else None,
    )
    assert torch.equal(engine.full_state_dict()["w"], torch.ones(4, 4))


def test_unsupported_precision_flag_names_the_supported_ones():
    from types import SimpleNamespace

    from zero_strategy.integrations.strategy_config import precision_flag

    assert precision_flag(SimpleNamespace(precision="bf16-mixed"), "Fabric") == "bf16-mixed"
    with pytest.raises(
        ValueError,
        match=r"Fabric\(precision='transformer-engine'\) is not supported.*one of \[.*'bf16-mixed'",
    ):
        precision_flag(SimpleNamespace(precision="transformer-engine"), "Fabric")


def test_a_second_model_or_optimizer_is_refused_with_the_fix():
    from zero_strategy.integrations.pairing import model_of, one_optimizer_message

    model, other = make_model(), make_model()
    assert model_of(make_optimizer(other), [model, other]) is other
    assert model_of(make_optimizer(other), [model]) is None  # the adapter names its call
    message = one_optimizer_message("The ZeRO strategy", "it has already sharded a model")
    assert "shards one model together with its optimizers, but it has already" in message
    assert "the model and every optimizer over it at once" in message


def test_an_older_torch_fails_at_import_naming_the_version():
    """Below torch 2.13 (no all_gather_single / reduce_scatter_single) the import itself
    fails, with the version needed, instead of the first collective deep in a step."""
    import subprocess
    import sys

    from zero_strategy import private_api

    with pytest.raises(ImportError, match=r"needs torch>=2\.13.*torch 2\.12\.1 is installed"):
        private_api.check_torch_version("2.12.1")
    private_api.check_torch_version("2.13.0+cpu")
    code = (
        "import torch; torch.__version__ = torch.torch_version.TorchVersion('2.11.0')\n"
        "import zero_strategy"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "pip install 'torch>=2.13'" in proc.stderr


def test_a_client_state_that_does_not_read_back_is_named_even_without_a_message(monkeypatch):
    """A safe load that fails with a bare exception (EOFError(): an empty buffer, as when
    torch.save is mocked) is reported by its type, not hidden by an IndexError."""
    from zero_strategy.checkpoint import save_agreement

    def bare_failure(*args, **kwargs):
        raise EOFError

    monkeypatch.setattr(save_agreement.torch, "load", bare_failure)
    with pytest.raises(ValueError, match=r"safe load \(weights_only=True\) refuses: EOFError\."):
        save_agreement.client_state_bytes({"epoch": 1})
