"""Trainer(strategy="zero1|2|3"): the same losses as DDP, resume, bad input."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from lightning_helpers import fit

from distributed import run_reference_world, run_world

L = pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def ddp_run():
    return run_world(fit, 2, "ddp")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_same_losses_as_ddp(strategy, ddp_run):
    runs = run_world(fit, 2, strategy)
    for rank, (ours, ddp) in enumerate(zip(runs, ddp_run)):
        assert ours["strategy"] == "ZeroStrategy"
        assert ours["sampler"] == "DistributedSampler"  # is_distributed
        assert len(ours["losses"]) == 40  # 20 optimizer steps x 2 micro-batches
        for i, (a, b) in enumerate(zip(ours["losses"], ddp["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, i, a, b)


def _resume_runs(tmp_path, strategy: str, accumulate: int):
    """Epochs of 5 steps; resume from the checkpoint written at the end of the first."""
    kw = dict(epoch_steps=5, accumulate=accumulate)
    full = run_world(fit, 2, strategy, 10, None, None, True, **kw)
    run_world(fit, 2, strategy, 10, str(tmp_path / strategy), None, True, **kw)
    ckpt = tmp_path / strategy / "step=5.ckpt"
    resumed = run_world(fit, 2, strategy, 10, None, str(ckpt), True, **kw)
    return full, resumed, ckpt


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_resume_with_ckpt_path_equals_the_uninterrupted_run(tmp_path, stage, accumulate):
    """Train one epoch (5 optimizer steps), save, resume for the second with ckpt_path:
    the continued losses, the scheduler and the step count are those of a 2-epoch run,
    bit for bit."""
    ckpt = str(tmp_path / "epoch1.ckpt")
    kw = dict(epoch_steps=5, accumulate=accumulate)
    full = run_world(fit, 2, stage, -1, None, None, True, max_epochs=2, **kw)
    run_world(fit, 2, stage, -1, None, None, True, save_at_end=ckpt, max_epochs=1, **kw)
    assert (tmp_path / "epoch1.ckpt" / "index.json").exists()
    resumed = run_world(fit, 2, stage, -1, None, ckpt, True, max_epochs=2, **kw)
    for a, b in zip(resumed, full):
        assert a["losses"] == b["losses"][5 * accumulate :]
        assert a["lr"] == b["lr"] and a["global_step"] == b["global_step"] == 10


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_from_a_sharded_checkpoint_continues_as_ddp_does(tmp_path, accumulate):
    """ModelCheckpoint in the middle of a max_steps run: Lightning re-enters the epoch at
    batch_idx 5 and starts the next epoch early, so the continuation is not the
    uninterrupted run's, for DDP either; ZeRO continues exactly as DDP does."""
    _, ddp, _ = _resume_runs(tmp_path, "ddp", accumulate)
    _, ours, ckpt = _resume_runs(tmp_path, "zero3", accumulate)
    assert (ckpt / "index.json").exists() and (ckpt / "client_state.pt").exists()
    for a, b in zip(ours, ddp):
        assert a["global_step"] == b["global_step"] == 10
        assert a["lr"] == b["lr"]  # the scheduler came back too
        assert all(
            abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)
        )


def test_strategy_instance_with_options():
    from zero_strategy.integrations.lightning import ZeroStrategy

    s = ZeroStrategy(stage=2, bucket_size=1000, gradient_clipping=0.0)
    assert s.engine_config.stage == 2 and s.engine_config.bucket_size == 1000


@pytest.mark.parametrize("root", ["lightning.pytorch", "pytorch_lightning"])
def test_a_ddp_strategy_object_can_become_the_zero_strategy(root):
    """The strategy's parts are mixins with Lightning's `Strategy` layout, so a
    `DDPStrategy` built elsewhere (by a test harness, by a wrapper) can take the class
    with `obj.__class__ = ZeroStrategy`, as it could when the class derived from
    DDPStrategy alone."""
    import importlib

    from zero_strategy.integrations.lightning import register

    pytest.importorskip(root)
    ddp = importlib.import_module(f"{root}.strategies").DDPStrategy()
    ddp.__class__ = register(root)
    assert type(ddp).__name__ == "ZeroStrategy"


def test_unknown_option_is_refused_with_the_known_ones():
    from zero_strategy import ZeroConfigError
    from zero_strategy.integrations.lightning import register

    with pytest.raises(ZeroConfigError, match=r"Unknown ZeroConfig option\(s\) \['bucket_sise'\]"):
        register("lightning.pytorch")(stage=3, bucket_sise=10)


def test_name_typo_gets_lightnings_own_error():
    """The names are registered, and Lightning's connector is left as Lightning wrote it: a
    typo gets Lightning's own message."""
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    import zero_strategy  # noqa: F401

    assert {"zero1", "zero2", "zero3"} <= set(StrategyRegistry)
    assert _AcceleratorConnector.__init__.__module__ == _AcceleratorConnector.__module__
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='zro3'`"):
        L.Trainer(strategy="zro3", accelerator="cpu", devices=1)


def test_mps_is_refused():
    from zero_strategy.integrations.lightning import register

    cls = register("lightning.pytorch")
    strategy = cls(stage=3)
    import torch

    strategy.parallel_devices = [torch.device("mps")]
    with pytest.raises(RuntimeError, match="not on 'mps'"):
        strategy.setup_environment()


def _fit_with_value_clipping(rank, world):
    return fit(rank, world, "zero2", 4, gradient_clip_algorithm="value")


def test_clip_by_value_is_supported_and_matches_ddp():
    ours = run_world(_fit_with_value_clipping, 2)
    ddp = run_world(fit, 2, "ddp", 4, None, None, False, gradient_clip_algorithm="value")
    for a, b in zip(ours, ddp):
        assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a["losses"], b["losses"]))


def test_environment_is_clean():
    assert "LOCAL_RANK" not in os.environ  # ranks run in forked children only


def _fit_precision(rank, world, precision):
    return fit(rank, world, "zero3", 6, precision=precision)


@pytest.mark.parametrize(
    "precision,compute",
    # Lightning turns "16-mixed" into "bf16-mixed" on CPU; "16-true" reaches fp16 compute
    # (fp32 masters, dynamic loss scaling) as "16-mixed" does on CUDA.
    [("bf16-mixed", "fp32"), ("bf16-true", "bf16"), ("16-mixed", "fp32"), ("16-true", "fp16")],
)
def test_precision_flags_train_close_to_fp32(precision, compute):
    """bf16/fp16 keep 8/11 significant bits; masters, optimizer state and the loss stay
    fp32, so over 6 steps the losses stay within 2e-2 of fp32 training."""
    fp32 = run_world(fit, 2, "zero3", 6)
    low = run_world(_fit_precision, 2, precision)
    for a, b in zip(low, fp32):
        assert a["compute_dtype"] == compute
        assert len(a["losses"]) == len(b["losses"]) == 12
        assert all(abs(x - y) <= 2e-2 * abs(y) for x, y in zip(a["losses"], b["losses"]))


def _evaluate(rank, world):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    trainer = quiet_trainer(world, "zero3", max_steps=2)
    module = lit_module_class()()
    trainer.fit(module, loader(n_batches=4, world=world), loader(n_batches=2, world=world))
    val = trainer.validate(module, loader(n_batches=2, world=world), verbose=False)[0]["val_loss"]
    fresh = quiet_trainer(world, "zero3")
    module.test_step = module.validation_step
    fresh.test(module, loader(n_batches=2, world=world), verbose=False)
    return val


def test_validate_and_test_run_with_sharded_parameters():
    vals = run_world(_evaluate, 2)
    assert vals[0] == vals[1] and 0 < vals[0] < 10  # sync_dist: the same on every rank


def _gan(rank, world, strategy, shared=False):
    """Manual optimization with two optimizers, as Lightning's GAN example: each step
    toggles one optimizer's parameters, clips them by their own norm, and steps it.
    `shared`: the generator's optimizer steps the discriminator's first layer too."""
    import lightning as L
    from lightning_helpers import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    def cleared(optimizer, model_params) -> tuple[bool, bool]:
        """Whether the optimizer's parameters, and the model's it steps, read .grad None."""
        held = [p for group in optimizer.param_groups for p in group["params"]]
        return all(p.grad is None for p in held), all(p.grad is None for p in model_params)

    class GAN(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.generator = torch.nn.Sequential(
                torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)
            )
            self.discriminator = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )
            self.automatic_optimization = False
            self.losses: list[float] = []
            self.cleared: list[tuple[bool, bool]] = []  # after each zero_grad()

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            noise = torch.randn(
                real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx)
            )
            bce = torch.nn.functional.binary_cross_entropy_with_logits
            self.toggle_optimizer(opt_g)
            fake = self.generator(noise)
            g_loss = bce(self.discriminator(fake), torch.ones(real.shape[0], 1))
            self.manual_backward(g_loss)
            self.clip_gradients(opt_g, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
            opt_g.step()
            opt_g.zero_grad()
            self.cleared.append(cleared(opt_g, self.g_params()))
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            d_loss = bce(self.discriminator(real), torch.ones(real.shape[0], 1)) + bce(
                self.discriminator(self.generator(noise).detach()), torch.zeros(real.shape[0], 1)
            )
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.cleared.append(cleared(opt_d, self.discriminator.parameters()))
            self.untoggle_optimizer(opt_d)
            self.losses.append((g_loss.item(), d_loss.item()))

        def g_params(self) -> list[torch.nn.Parameter]:
            g_params = list(self.generator.parameters())
            if shared:
                g_params += list(self.discriminator[0].parameters())
            return g_params

        def configure_optimizers(self):
            return (
                torch.optim.Adam(self.g_params(), lr=1e-2),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.9),
            )

    data = torch.randn(6 * 4 * world, 8, generator=torch.Generator().manual_seed(1))
    module = GAN()
    trainer = quiet_trainer(world, strategy, max_epochs=1)
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=4))
    final = final_parameters(trainer, module)
    return module.losses, final, module.cleared


@pytest.mark.parametrize("shared", [False, True], ids=["disjoint", "shared"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_optimizers_with_manual_optimization_match_ddp(stage, shared):
    ddp = run_world(_gan, 2, "ddp_find_unused_parameters_true", shared)
    ours = run_world(_gan, 2, f"zero{stage}", shared)
    assert_matches_ddp([r[:2] for r in ours], [r[:2] for r in ddp], n_losses=6)
    for (*_, cleared), (*_, ddp_cleared) in zip(ours, ddp):
        assert cleared == ddp_cleared  # each optimizer's zero_grad() leaves None, as DDP's
        assert ddp_cleared == [(True, True)] * 12


def _fit_twice(rank, world, strategy):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    module = lit_module_class()()
    for steps in (3, 6):  # a new Trainer: 6 more steps, with new optimizers
        trainer = quiet_trainer(world, strategy, max_steps=steps)
        trainer.fit(module, loader(n_batches=6, world=world))
    final = final_parameters(trainer, module)
    return module.losses, final


@pytest.mark.parametrize("stage", [1, 3])
def test_fit_twice_on_the_same_module_matches_ddp(stage):
    ddp = run_reference_world(_fit_twice, 2, "ddp")
    ours = run_world(_fit_twice, 2, f"zero{stage}")
    assert_matches_ddp(ours, ddp, n_losses=9)


def _manual(rank, world, strategy):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    class Manual(lit_module_class()):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = self.model(x, y)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.losses.append(loss.item())

        def on_train_batch_end(self, *_):  # the step's opt.zero_grad() is seen here
            self.grads_after_step.append(all(p.grad is None for p in self.parameters()))

    module = Manual()
    module.grads_after_step = []
    trainer = quiet_trainer(world, strategy, max_steps=6)
    trainer.fit(module, loader(n_batches=6, world=world))
    return module.losses, module.grads_after_step


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manual_optimization_with_one_optimizer_matches_ddp(stage):
    ddp = run_reference_world(_manual, 2, "ddp")
    ours = run_world(_manual, 2, f"zero{stage}")
    for (a, cleared), (b, ddp_cleared) in zip(ours, ddp):
        assert len(a) == 6 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))
        assert cleared == ddp_cleared == [True] * 6  # .grad is None after the step, as DDP


def _weights_read_at_batch_start(rank, world, strategy):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    class Reading(lit_module_class()):
        def on_train_batch_start(self, batch, batch_idx):  # between two steps
            self.sums.append(float(sum(p.double().sum() for p in self.parameters())))

    module = Reading()
    module.sums = []
    trainer = quiet_trainer(world, strategy, max_steps=4)
    trainer.fit(module, loader(n_batches=4, world=world))
    return module.sums


@pytest.mark.parametrize("stage", [1, 2])
def test_a_users_batch_hook_reads_the_stepped_weights_as_under_ddp(stage):
    """Stages 1-2 finish a step's parameter gathers in the next forward, unless code
    outside Lightning defines a hook between steps: then at once, so that it reads the
    updated weights."""
    ddp = run_reference_world(_weights_read_at_batch_start, 2, "ddp")
    ours = run_world(_weights_read_at_batch_start, 2, f"zero{stage}")
    for sums, ddp_sums in zip(ours, ddp):
        assert len(sums) == 4
        torch.testing.assert_close(sums, ddp_sums, rtol=1e-6, atol=1e-6)


def _configure_model(rank, world):
    import lightning as L
    from lightning_helpers import loader, quiet_trainer

    from examples.gpt import GPT, GPTConfig

    big = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=256)
    seen = {}

    class Sharded(L.LightningModule):
        def configure_model(self):
            self.model = GPT(big)
            seen["built_on_meta"] = all(p.is_meta for p in self.model.parameters())

        def training_step(self, batch, batch_idx):
            return self.model(*batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    module = Sharded()
    trainer = quiet_trainer(world, "zero3", max_steps=2)
    trainer.fit(module, loader(n_batches=2, world=world))
    held = trainer.strategy.engine.memory_report()["parameters"]
    full = 4 * sum(u.layout.numel for u in trainer.strategy.engine.units)
    return seen["built_on_meta"], held, full


def test_configure_model_builds_on_meta_and_each_rank_holds_its_shard():
    for on_meta, held, full in run_world(_configure_model, 2):
        assert on_meta
        assert held <= full / 2 + 4 * 16


def _pytorch_lightning_fit(rank, world):
    import pytorch_lightning as pl
    from lightning_helpers import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    import zero_strategy  # noqa: F401
    from training import make_model, make_optimizer

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model()

        def training_step(self, batch, batch_idx):
            return self.model(*batch)

        def configure_optimizers(self):
            return make_optimizer(self.model)

    data = torch.randint(64, (8, 17))
    trainer = quiet_trainer(world, "zero2", pl_module=pl, max_steps=2)
    trainer.fit(Lit(), DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2))
    return type(trainer.strategy).__module__, trainer.global_step


def test_pytorch_lightning_package_has_the_names_too():
    pytest.importorskip("pytorch_lightning")
    for module, steps in run_world(_pytorch_lightning_fit, 2):
        assert module == "zero_strategy.integrations.lightning" and steps == 2


def test_a_failing_registration_never_breaks_the_framework_import():
    from zero_strategy import integrations

    def broken():
        raise AttributeError("internals moved")

    with pytest.warns(
        UserWarning, match="could not register its strategies with x.y: .*internals moved"
    ):
        integrations._safely(broken, "x.y")


def _predict(rank, world):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    class Predicting(lit_module_class()):
        def predict_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x, y)

    live_groups = len(torch.distributed.distributed_c10d._world.pg_map)
    module = Predicting()
    trainer = quiet_trainer(world, "zero3", max_steps=2)
    trainer.fit(module, loader(n_batches=4, world=world))
    closed_after_fit = trainer.strategy.engine.closed
    out = trainer.predict(module, loader(n_batches=2, world=world))
    gathered = trainer.strategy.engine.memory_report()["gathered_parameters"]
    groups_left = len(torch.distributed.distributed_c10d._world.pg_map) - live_groups
    return [float(v) for v in out], gathered, closed_after_fit, groups_left


def test_predict_after_fit_gathers_then_frees():
    """Teardown destroys the engine's groups; predict on the same module re-creates them
    and its teardown destroys them again."""
    for losses, gathered, closed_after_fit, groups_left in run_world(_predict, 2):
        assert len(losses) == 2 and all(0 < v < 10 for v in losses)
        assert gathered == 0
        assert closed_after_fit and groups_left == 0


def _batchnorm_fit(rank, world, strategy):
    """A BatchNorm module trained on rank-dependent data, then validated: each rank's
    validation loss depends on the running statistics it holds."""
    from lightning_helpers import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    class BatchNormNet(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = batchnorm_net()
            self.val_losses = []

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x * (1 + self.global_rank)).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            (x,) = batch
            self.val_losses.append(self.net(x).pow(2).mean().item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    data = torch.randn(48, 8, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(data), batch_size=6)
    trainer = quiet_trainer(
        world, strategy, max_steps=3, num_sanity_val_steps=0, limit_val_batches=2
    )
    module = BatchNormNet()
    trainer.fit(module, loader)
    trainer.validate(module, loader, verbose=False)
    assert len(module.val_losses) == 2
    return module.val_losses, module.net[1].running_mean.clone()


def test_batchnorm_statistics_follow_ddp():
    """Rank 0's statistics reach every rank before each forward that follows a training
    forward, as under DDP's broadcast_buffers: validation on rank 1 sees what DDP gives."""
    ddp = run_world(_batchnorm_fit, 2, "ddp")
    ours = run_world(_batchnorm_fit, 2, "zero3")
    for (our_val, our_mean), (ddp_val, ddp_mean) in zip(ours, ddp):
        assert our_val == pytest.approx(ddp_val, rel=1e-5)
        torch.testing.assert_close(our_mean, ddp_mean, rtol=1e-5, atol=1e-6)


def _summary_and_state_dict_after_fit(rank, world, strategy):
    from lightning.pytorch.callbacks import ModelSummary
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    module = lit_module_class()()
    full_counts = {name: p.numel() for name, p in module.named_parameters()}
    trainer = quiet_trainer(world, strategy, max_steps=2, enable_model_summary=True)
    trainer.fit(module, loader(n_batches=2, world=world))
    # The trainer's own summary callback (the one that printed the table at fit start).
    callback = next(c for c in trainer.callbacks if isinstance(c, ModelSummary))
    summary = callback._summary(trainer, module)
    stock = type(callback)(max_depth=1)._summary(trainer, module)  # a fresh one: the same
    state = module.state_dict()
    return {
        "full_total": sum(full_counts.values()),
        "summary_total": summary.total_parameters,
        "summary_trainable": summary.trainable_parameters,
        "layer_total": summary.total_layer_params,
        "stock_total": stock.total_parameters,
        "state": state,
        "masters": trainer.strategy.engine.full_state_dict(rank0_only=False),
    }


def test_model_summary_and_state_dict_after_fit_see_the_full_model():
    """Lightning's summary counts p.numel(): a freed stage-3 parameter keeps its shape, so
    the trainer's summary and any other count the full model with nothing routed or
    patched; after fit, `module.state_dict()` (called on every rank) holds the trained
    full values."""
    for result in run_world(_summary_and_state_dict_after_fit, 2, "zero3"):
        # GPT ties lm_head to wte: named_parameters() lists the shared tensor once.
        assert result["summary_total"] == result["full_total"] > 0
        assert result["summary_trainable"] == result["full_total"]
        assert result["layer_total"] == result["full_total"]
        assert result["stock_total"] == result["full_total"]
        assert result["state"].keys() == result["masters"].keys()
        for name, value in result["state"].items():
            assert torch.equal(value, result["masters"][name]), name


def _strategy_state_after_fit(rank, world, strategy, ckpt):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    from zero_strategy.integrations.lightning import ZeroStrategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    if strategy != "ddp":
        strategy = ZeroStrategy(stage=int(strategy[-1]), state_dict_type="full")
    module = lit_module_class()()
    trainer = quiet_trainer(world, strategy, max_steps=3)
    trainer.fit(module, loader(n_batches=3, world=world))
    state = trainer.strategy.lightning_module_state_dict()
    optimizer = trainer.strategy.optimizer_state(module.optimizers())
    trainer.save_checkpoint(ckpt)  # a save after the user's calls writes the same
    return state, optimizer


@pytest.mark.parametrize("stage", [1, 3])
def test_the_strategys_model_and_optimizer_state_are_ddps_on_rank_0(stage, tmp_path):
    """`trainer.strategy.lightning_module_state_dict()` and `.optimizer_state(opt)` called
    by user code hand the whole state, as DDP's (in its order, torch's numbering), on rank
    0 and nothing elsewhere, as FSDPStrategy's "full"; Lightning's own save still gets the
    marker and writes from the shards: the checkpoint holds what was handed out."""
    ddp = run_world(_strategy_state_after_fit, 2, "ddp", str(tmp_path / "ddp.ckpt"))
    path = tmp_path / "zero.ckpt"
    (state, optimizer), rest = run_world(_strategy_state_after_fit, 2, f"zero{stage}", str(path))
    assert rest == ({}, {})
    ddp_state, ddp_optimizer = ddp[0]
    assert list(state) == list(ddp_state)
    torch.testing.assert_close(state, ddp_state, rtol=1e-5, atol=1e-6)
    assert optimizer["param_groups"] == ddp_optimizer["param_groups"]
    torch.testing.assert_close(optimizer["state"], ddp_optimizer["state"], rtol=1e-4, atol=1e-7)
    saved = torch.load(path, weights_only=True)
    torch.testing.assert_close(saved["state_dict"], state, rtol=0, atol=0)
    by_name = saved["optimizer_states"][0]["state"]
    names = [n for g in saved["optimizer_states"][0]["param_groups"] for n in g["params"]]
    for i, name in enumerate(names):
        torch.testing.assert_close(by_name[name], optimizer["state"][i], rtol=0, atol=0)


def _validate_from_a_checkpoint_in_a_fresh_trainer(rank, world, ckpt):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    data = loader(n_batches=2, world=world)
    trainer = quiet_trainer(world, "zero3", max_steps=3, num_sanity_val_steps=0)
    module = lit_module_class()()
    trainer.fit(module, data)
    trainer.save_checkpoint(ckpt, weights_only=False)
    after_fit = trainer.validate(module, data, verbose=False)
    # A new process would do this: another module, another Trainer, the checkpoint's path.
    fresh = lit_module_class()()
    torch.nn.init.zeros_(fresh.model.lm_head.weight)  # nothing may survive from init
    validated = quiet_trainer(world, "zero3").validate(fresh, data, ckpt_path=ckpt, verbose=False)

    class Testing(lit_module_class()):
        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.model(*batch), sync_dist=True)

    tested = quiet_trainer(world, "zero3").test(Testing(), data, ckpt_path=ckpt, verbose=False)
    return after_fit, validated, tested


def test_validate_and_test_load_a_training_checkpoint_into_a_fresh_trainer(tmp_path):
    """Evaluation holds a stand-in optimizer, so it reads the model alone from the
    checkpoint (the trained AdamW state is not needed and is not a mismatch)."""
    ckpt = str(tmp_path / "trained.ckpt")
    for after_fit, validated, tested in run_world(
        _validate_from_a_checkpoint_in_a_fresh_trainer, 2, ckpt
    ):
        assert validated == after_fit
        assert tested[0]["test_loss"] == after_fit[0]["val_loss"]  # same data, same model


def _sync_batchnorm_types(rank, world):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")

    class WithBatchNorm(lit_module_class()):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)  # SyncBatchNorm runs on GPUs only: unused
            self.seen = None

        def on_fit_start(self):
            self.seen = type(self.norm).__name__

    module = WithBatchNorm()
    trainer = quiet_trainer(world, "zero1", max_steps=1, sync_batchnorm=True)
    trainer.fit(module, loader(n_batches=1, world=world))
    return module.seen, type(module.norm).__name__


def test_sync_batchnorm_converts_for_fit_and_stays_for_evaluation():
    """Trainer(sync_batchnorm=True): SyncBatchNorm while fitting, as under DDP. Unlike
    DDP it is not reverted after fit: the engine's hooks live on those modules and later
    validate/test calls reuse them (a reverted module would lose its stage-3 gathers)."""
    for during, after in run_world(_sync_batchnorm_types, 2):
        assert during == after == "SyncBatchNorm"


def test_lightning_cli_config_takes_zero_options_as_init_args(tmp_path):
    """A LightningCLI YAML names the class and its options, as for DeepSpeedStrategy; the
    options are checked against the ZeroConfig field types while parsing."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI
    from lightning_helpers import lit_module_class

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  strategy:\n"
        "    class_path: zero_strategy.integrations.lightning.ZeroStrategy\n"
        "    init_args: {stage: 2, bucket_size: 100000, overlap_comm: false}\n"
    )
    cli = LightningCLI(
        lit_module_class(), run=False, args=["--config", str(config)], save_config_callback=None
    )
    zero = cli.trainer.strategy.engine_config
    assert (zero.stage, zero.bucket_size, zero.overlap_comm) == (2, 100000, False)
    config.write_text(config.read_text().replace("100000", "lots"))
    with pytest.raises(SystemExit):
        LightningCLI(
            lit_module_class(), run=False, args=["--config", str(config)], save_config_callback=None
        )


def _init_module_on_meta(rank, world):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    trainer = quiet_trainer(world, "zero3", max_steps=2)
    # (Lightning suggests configure_model on rank 0, as it does for FSDP.)
    with trainer.init_module(empty_init=True):
        module = lit_module_class()()
    on_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader(n_batches=4, world=world))
    engine = trainer.strategy.engine
    shard_bytes = sum(u.layout.shard_numel for u in engine.units) * 4
    return on_meta, engine.memory_report()["parameters"] == shard_bytes, module.losses


def test_init_module_with_empty_init_builds_on_meta_and_shards():
    """trainer.init_module(empty_init=True): nothing is allocated until the engine
    materialises each rank's shard (the DDP base would build the model on the device)."""
    for on_meta, holds_shard, losses in run_world(_init_module_on_meta, 2):
        assert on_meta and holds_shard
        assert len(losses) == 2 and all(0 < v < 10 for v in losses)


def _double(rank, world, strategy):
    import lightning as L
    from lightning_helpers import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    class Double(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = batchnorm_net()
            self.dtypes: set[torch.dtype] = set()

        def training_step(self, batch, batch_idx):
            x, y = batch
            made_here = torch.tensor([0.0]).dtype  # the default dtype inside a step
            self.dtypes |= {x.dtype, self.net[1].running_mean.dtype, self.dtype, made_here}
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    module = Double()
    trainer = quiet_trainer(
        world, strategy, max_epochs=2, precision="64-true", gradient_clip_val=0.5
    )
    trainer.fit(module, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    final = final_parameters(trainer, module)
    return module.dtypes, final


@pytest.mark.parametrize("stage", [1, 3])
def test_precision_64_true_trains_in_fp64_as_ddp_does(stage):
    ddp = run_reference_world(_double, 2, "ddp")
    ours = run_world(_double, 2, f"zero{stage}")
    for (dtypes, final), (_, ddp_final) in zip(ours, ddp):
        assert dtypes == {torch.float64}
        for name, value in ddp_final.items():
            assert final[name].dtype == torch.float64
            # fp64 all the way: far closer than any fp32 step could land
            torch.testing.assert_close(final[name], value, rtol=1e-8, atol=1e-10)


def _averaged(rank, world, strategy, kind):
    import lightning as L
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    from zero_strategy.integrations.lightning import (
        ZeroEMAWeightAveraging,
        ZeroStochasticWeightAveraging,
        ZeroWeightAveraging,
    )

    cb = L.pytorch.callbacks
    val_losses = []

    class ReadingMean(cb.WeightAveraging):
        """A user's subclass whose own hook reads the weights between steps."""

        def on_train_epoch_start(self, trainer, pl_module):  # a hook the stock one lacks
            val_losses.append(float(sum(p.double().sum() for p in pl_module.parameters())))

    callback = {
        "stock-ema": lambda: cb.EMAWeightAveraging(decay=0.8, use_buffers=False),
        "zero-ema": lambda: ZeroEMAWeightAveraging(decay=0.8),
        "stock-mean": lambda: cb.WeightAveraging(use_buffers=False),
        "zero-mean": lambda: ZeroWeightAveraging(use_buffers=False),
        "stock-swa": lambda: cb.StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1),
        "zero-swa": lambda: ZeroStochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1),
        "reading-mean": lambda: ReadingMean(use_buffers=False),
    }[kind]()
    module = lit_module_class()()

    class Record(L.pytorch.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            val_losses.append(float(trainer.callback_metrics["val_loss"]))

    trainer = quiet_trainer(world, strategy, max_epochs=3, callbacks=[callback, Record()])
    trainer.fit(module, loader(n_batches=4, world=world), loader(n_batches=2, world=world))
    final = final_parameters(trainer, module)
    return val_losses, final


@pytest.mark.parametrize(
    ("ours", "stock", "strategy"),
    [
        ("zero-ema", "stock-ema", "zero3"),
        ("stock-ema", "stock-ema", "zero2"),  # the stock callback, as it is, at stages 1-2
        ("zero-mean", "stock-mean", "zero3"),
        ("zero-swa", "stock-swa", "zero3"),
        ("stock-swa", "stock-swa", "zero1"),
        # The stock callbacks at stage 3 as they are: their hooks gather the parameters.
        ("stock-ema", "stock-ema", "zero3"),
        ("stock-swa", "stock-swa", "zero3"),
        ("reading-mean", "reading-mean", "zero3"),  # a subclass's own hook too
    ],
)
def test_weight_averaging_matches_ddp(ours, stock, strategy):
    ddp = run_reference_world(_averaged, 2, "ddp", stock)
    zero = run_world(_averaged, 2, strategy, ours)
    for (val, final), (ddp_val, ddp_final) in zip(zero, ddp):
        assert len(val) == len(ddp_val) >= 3
        torch.testing.assert_close(val, ddp_val, rtol=1e-5, atol=1e-6)  # validated averaged
        for name, value in ddp_final.items():  # and left in the model at the end
            torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6)


def _adopted_names(rank, world, strategy):
    import lightning as L
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    swa = L.pytorch.callbacks.StochasticWeightAveraging(swa_lrs=1e-3)
    trainer = quiet_trainer(world, strategy, max_epochs=1, callbacks=[swa])
    trainer.fit(lit_module_class()(), loader(n_batches=2, world=world))
    return (
        type(swa).__name__,
        swa.state_key,
        isinstance(swa, L.pytorch.callbacks.StochasticWeightAveraging),
    )


def test_stock_averaging_adopted_at_stage_3_keeps_its_name_and_checkpoint_key():
    for name, key, still_stock in run_world(_adopted_names, 2, "zero3"):
        assert (name, key, still_stock) == (
            "StochasticWeightAveraging",
            "StochasticWeightAveraging",
            True,
        )


def _fit_after_exception(rank, world, strategy, ckpt_dir):
    import lightning as L
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    class Flaky(lit_module_class()):
        fail_at: int | None = 3

        def training_step(self, batch, batch_idx):
            if self.fail_at is not None and self.global_step == self.fail_at:
                raise RuntimeError("a node went away")
            return super().training_step(batch, batch_idx)

    module = Flaky()
    on_exception = L.pytorch.callbacks.OnExceptionCheckpoint(dirpath=ckpt_dir, filename="crash")
    trainer = quiet_trainer(
        world, strategy, max_steps=6, callbacks=[on_exception], enable_checkpointing=True
    )
    try:
        trainer.fit(module, loader(n_batches=6, world=world))
    except RuntimeError as e:
        assert "a node went away" in str(e)
    saved = os.path.join(ckpt_dir, "crash.ckpt")
    module.fail_at = None
    resumed = quiet_trainer(world, strategy, max_steps=6)  # the same module, again
    resumed.fit(module, loader(n_batches=6, world=world), ckpt_path=saved)
    final = final_parameters(resumed, module)
    return module.losses, final


def test_fit_again_after_an_exception_resumes_from_its_checkpoint_as_ddp(tmp_path):
    ddp = run_world(_fit_after_exception, 2, "ddp", str(tmp_path / "ddp"))
    ours = run_world(_fit_after_exception, 2, "zero3", str(tmp_path / "zero3"))
    assert_matches_ddp(ours, ddp, n_losses=6)


def _saved_where_rank_0_says(rank, world, strategy, base):
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    module = lit_module_class()()
    trainer = quiet_trainer(world, strategy, max_steps=2)
    trainer.fit(module, loader(n_batches=2, world=world))
    trainer.save_checkpoint(os.path.join(base, f"rank{rank}", "last.ckpt"))  # differ by rank
    resumed = quiet_trainer(world, strategy, max_steps=3)
    resumed.fit(
        module, loader(n_batches=2, world=world), ckpt_path=os.path.join(base, "rank0", "last.ckpt")
    )
    return resumed.global_step


def test_a_save_whose_path_differs_by_rank_lands_at_rank_0s_path(tmp_path):
    """As Lightning's FSDP strategy: the ranks write rank 0's path together (Lightning's
    test_result_collection_reload names one temporary directory per rank)."""
    assert run_world(_saved_where_rank_0_says, 2, "zero3", str(tmp_path)) == [3, 3]
    assert os.path.isdir(tmp_path / "rank0" / "last.ckpt")
    assert not os.path.exists(tmp_path / "rank1")


def final_parameters(trainer, module) -> dict[str, torch.Tensor]:
    """The module's full parameters after fit, as DDP holds them (gathered at stage 3)."""
    engine = getattr(trainer.strategy, "engine", None)
    with engine.gathered_parameters() if engine else contextlib.nullcontext():
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_matches_ddp(ours, ddp, n_losses: int) -> None:
    """Each rank's (losses, final parameters) against DDP's."""
    for (losses, final), (ddp_losses, ddp_final) in zip(ours, ddp):
        assert len(losses) == n_losses
        torch.testing.assert_close(losses, ddp_losses, rtol=1e-5, atol=1e-6)
        for name, value in ddp_final.items():
            torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6)


def batchnorm_net() -> torch.nn.Sequential:
    """A small net with BatchNorm statistics (buffers), seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )


def _root_parameters_read_in_steps(rank, world, strategy):
    """A LightningModule's own parameters (the root unit: beside a ModuleList of blocks)
    used or read directly in its steps, not through a submodule's forward: a learnable
    scale multiplied in training_step, a head's weight read in test_step (as Lightning's
    own test_params_synced_during_nonfit reads `self.layer.weight.item()`)."""
    import lightning as L
    from lightning_helpers import quiet_trainer

    class ReadsItsOwnParameters(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1 + rank)  # different on each rank: the strategy syncs them
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
            self.head = torch.nn.Linear(3, 1)
            self.scale = torch.nn.Parameter(torch.full((1,), 0.5))
            self.seen: list[list[float]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append([self.scale.item(), *self.head.weight.flatten().tolist()])
            hidden = self.blocks[0](batch[0]) * self.scale  # the parameter itself, used
            return self.head(hidden).pow(2).mean()

        def forward(self, x):
            return self.head(self.blocks[0](x) * self.scale)

        def test_step(self, batch, batch_idx):
            if batch_idx % 2:  # the root's forward first: the step still holds the root
                self(batch[0])
            self.seen.append([self.scale.item(), *self.head.weight.flatten().tolist()])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = ReadsItsOwnParameters()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * world, 3, generator=g))
    trainer = quiet_trainer(world, strategy, max_steps=3)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    trainer.test(module, torch.utils.data.DataLoader(data, batch_size=2), verbose=False)
    return module.seen


def test_root_parameters_used_directly_in_a_step_are_whole_as_under_ddp():
    ddp = run_world(_root_parameters_read_in_steps, 2, "ddp")
    zero = run_world(_root_parameters_read_in_steps, 2, "zero3")
    assert ddp[0] == ddp[1] and len(ddp[0]) == 3 + 4  # 3 steps, 4 test batches
    for ours, reference in zip(zero, ddp):
        assert len(ours) == len(reference)
        for got, want in zip(ours, reference):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)


def _weights_pinned_in_the_step(rank, world, strategy):
    """A training_step that pins weights by `.data` assignment before the module runs
    (Lightning's own spike-detection tests write `self.layer.weight.data = ones` so): a
    block's weight (a unit of its own at stage 3) and a head the root unit holds. Under
    DDP the module computes with the pinned values and the step updates from them."""
    import lightning as L
    from lightning_helpers import quiet_trainer

    class PinsWeights(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
            self.head = torch.nn.Linear(3, 1, bias=False)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            with torch.no_grad():
                self.blocks[0].weight.data = torch.eye(3)
                if batch_idx % 2:
                    self.head.weight.data = torch.ones_like(self.head.weight.data)
            loss = self.head(torch.tanh(self.blocks[0](batch[0]))).pow(2).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = PinsWeights()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * world, 3, generator=g))
    trainer = quiet_trainer(world, strategy, max_steps=4)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module.losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_weights_pinned_by_data_in_a_training_step_are_computed_with_as_under_ddp(stage):
    ddp = run_reference_world(_weights_pinned_in_the_step, 2, "ddp")
    ours = run_world(_weights_pinned_in_the_step, 2, f"zero{stage}")
    for got, want in zip(ours, ddp):
        assert len(got) == len(want) == 4
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)


def _read_at_epoch_end(rank, world, strategy, pruning):
    """A callback reading the parameters at each epoch's end (a user's weight statistics),
    or Lightning's ModelPruning (masks computed there)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelPruning
    from lightning_helpers import quiet_trainer

    class Small(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first = torch.nn.Linear(4, 8)
            self.second = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.second(torch.tanh(self.first(batch[0]))).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Reader(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.seen.append(pl_module.first.weight.detach().clone())

    module, reader = Small(), Reader()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4 * world, 4, generator=g))
    # The lottery-ticket reset at the first epoch's end only: it writes `weight_orig.data`,
    # which under DDP then shares memory with the callback's copy of the initial weights,
    # so a later reset there would restore trained values, not the initial ones.
    ticket = lambda epoch: epoch == 0  # noqa: E731
    callbacks = (
        [ModelPruning("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=ticket)]
        if pruning
        else [reader]
    )
    trainer = quiet_trainer(world, strategy, max_epochs=3 if pruning else 2, callbacks=callbacks)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    except RuntimeError as error:
        return str(error)
    if pruning:
        return final_parameters(trainer, module)
    return reader.seen


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_read_at_an_epochs_end_are_the_last_steps_as_under_ddp(stage):
    ddp = run_reference_world(_read_at_epoch_end, 2, "ddp", False)
    ours = run_world(_read_at_epoch_end, 2, f"zero{stage}", False)
    for got, want in zip(ours, ddp):
        assert len(got) == len(want) == 2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_pruning_with_its_lottery_ticket_reset_matches_ddp(stage):
    """ModelPruning writes `weight_orig.data` (the lottery ticket) at an epoch's end, and
    `.data` again when it makes the pruning permanent: the engine adopts what was written
    and trains on from it (the step's updates used to stop reaching the module). At stage
    3 the strategy adopts the callback: its hooks run with the parameters gathered."""
    ddp = run_reference_world(_read_at_epoch_end, 2, "ddp", True)
    ours = run_world(_read_at_epoch_end, 2, f"zero{stage}", True)
    for got, want in zip(ours, ddp):
        assert got.keys() == want.keys()
        assert (got["first.weight"] == 0).sum() == (want["first.weight"] == 0).sum() > 0
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)


def _top_k(rank, world, strategy, ckpt_dir):
    """ModelCheckpoint keeping the 2 best of a monitor that differs per rank, checked 3
    times an epoch for 2 epochs (Lightning's top-k DDP test, with the saves counted
    instead of torch.save mocked): rank 0's saves and what stays on disk."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_helpers import quiet_trainer

    class PerRankMonitor(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("my_loss", float(batch_idx * (1 + self.global_rank)), on_epoch=True)
            return super().training_step(batch, batch_idx)

    saves = ModelCheckpoint(dirpath=ckpt_dir, monitor="my_loss_step", save_top_k=2, mode="max")
    trainer = quiet_trainer(
        world,
        strategy,
        callbacks=[saves],
        enable_checkpointing=True,
        max_epochs=2,
        val_check_interval=0.3,
        limit_train_batches=16,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    written = []
    save = trainer.save_checkpoint

    def counted_save(path, *args, **kwargs):
        written.append(os.path.basename(path))
        save(path, *args, **kwargs)

    trainer.save_checkpoint = counted_save
    trainer.fit(PerRankMonitor())
    kept = sorted(os.path.basename(p) for p in saves.best_k_models)
    return written, kept, sorted(os.listdir(ckpt_dir))


def test_top_k_checkpoints_of_a_per_rank_monitor_are_ddps(tmp_path):
    """Which checkpoints are written and which stay (the decision all ranks agree on,
    from rank 0's monitor) are DDP's; Lightning's own test counts DDP's torch.save calls
    through a mock, which says nothing of a writer that is not torch.save."""
    ddp = run_world(_top_k, 2, "ddp", str(tmp_path / "ddp"))
    ours = run_world(_top_k, 2, "zero3", str(tmp_path / "zero3"))
    assert ddp[0][0] and len(ddp[0][0]) > 2  # some saves were later dropped from the top 2
    assert ours[0] == ddp[0]
    assert ours[1][:2] == ddp[1][:2]
