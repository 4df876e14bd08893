"""Every private name of Lightning, Fabric, Accelerate and Transformers the integrations
rely on (`zero_strategy.integrations.private_api`), checked against the installed
versions: each exists, and the framework still reads it where the integrations need it."""

import inspect

import pytest
import torch

from zero_strategy.integrations import private_api as api

L = pytest.importorskip("lightning")


@pytest.mark.parametrize("root", ["lightning.pytorch", "pytorch_lightning"])
def test_the_precision_plugins_after_closure_is_what_lightnings_plugins_call(root):
    import importlib

    precision = importlib.import_module(f"{root}.plugins.precision")
    assert callable(precision.Precision._after_closure)
    assert "_after_closure(" in inspect.getsource(precision.MixedPrecision.optimizer_step)


def test_layer_sync_is_what_sync_batchnorm_sets():
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.connectors import accelerator_connector

    assert api.layer_sync(DDPStrategy()) is None
    assert "_layer_sync" in inspect.getsource(accelerator_connector)


@pytest.mark.parametrize("root", ["lightning.pytorch", "pytorch_lightning"])
def test_the_wrappers_optimizers_hands_out_run_the_optimizers_own_zero_grad(root):
    import importlib

    strategies = importlib.import_module(f"{root}.strategies")
    module = importlib.import_module(f"{root}.core.module")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    calls = []
    opt.zero_grad = lambda *args, **kwargs: calls.append((args, kwargs))
    strategy = strategies.SingleDeviceStrategy(device="cpu")
    strategy.optimizers = [opt]
    api.route_lightning_optimizers_zero_grad(strategy)
    strategy._lightning_optimizers[0].zero_grad(set_to_none=False)
    assert calls == [((), {"set_to_none": False})]
    assert "_lightning_optimizers" in inspect.getsource(module.LightningModule.optimizers)


@pytest.mark.parametrize("root", ["lightning.pytorch", "pytorch_lightning"])
def test_a_checkpoint_being_dumped_is_told_from_a_users_call(root, tmp_path):
    """Lightning's save asks the strategy for the model's and optimizers' state from
    `_CheckpointConnector.dump_checkpoint`; a user's own call does not come from there."""
    import importlib

    pl = importlib.import_module(root)
    demos = importlib.import_module(f"{root}.demos.boring_classes")
    asked = []

    class Probe(pl.strategies.SingleDeviceStrategy):
        def lightning_module_state_dict(self):
            asked.append(("model", api.dumping_a_checkpoint()))
            return super().lightning_module_state_dict()

        def optimizer_state(self, optimizer):
            asked.append(("optimizer", api.dumping_a_checkpoint()))
            return super().optimizer_state(optimizer)

    class AskingCallback(pl.Callback):  # user code asking during a save
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            trainer.strategy.lightning_module_state_dict()
            trainer.strategy.optimizer_state(trainer.optimizers[0])

    class Subclass(Probe):  # a user's subclass: its super() chain is still the save's
        def lightning_module_state_dict(self):
            return super().lightning_module_state_dict()

    trainer = pl.Trainer(
        strategy=Subclass(device="cpu"),
        callbacks=[AskingCallback()],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = demos.BoringModel()
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert asked == [("model", True), ("optimizer", True), ("model", False), ("optimizer", False)]
    asked.clear()
    trainer.strategy.lightning_module_state_dict()
    trainer.strategy.optimizer_state(trainer.optimizers[0])
    assert asked == [("model", False), ("optimizer", False)]


def test_a_modules_device_mesh_dtype_and_device_are_what_it_reports():
    module = L.LightningModule()
    mesh = object()
    api.give_device_mesh(module, mesh)
    assert module.device_mesh is mesh
    api.report_placement(module, torch.device("meta"), torch.float64)
    assert module.device == torch.device("meta") and module.dtype == torch.float64


def test_fabrics_backward_sync_control_is_read_by_no_backward_sync():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    base = api.backward_sync_control_base()
    assert inspect.isclass(base) and hasattr(base, "no_backward_sync")
    strategy = DDPStrategy()
    marker = object()
    api.set_backward_sync_control(strategy, marker)
    assert strategy._backward_sync_control is marker
    assert "_backward_sync_control" in inspect.getsource(Fabric.no_backward_sync)


def test_accelerates_prepared_marker_is_what_prepare_optimizer_reads():
    accelerate = pytest.importorskip("accelerate")
    source = inspect.getsource(accelerate.Accelerator.prepare_optimizer)
    assert "_is_accelerate_prepared" in source
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    api.mark_prepared(opt)
    assert opt._is_accelerate_prepared is True
    # The public property the ZeRO optimizer overrides instead of a private flag.
    from accelerate.optimizer import AcceleratedOptimizer

    assert isinstance(inspect.getattr_static(AcceleratedOptimizer, "step_was_skipped"), property)


def test_the_trainer_methods_zero_trainer_overrides_exist():
    transformers = pytest.importorskip("transformers")
    from zero_strategy.integrations.transformers import ZeroTrainer

    for name in api.TRAINER_METHODS:
        stock = getattr(transformers.Trainer, name)
        assert callable(stock), name
        mine = getattr(ZeroTrainer, name)
        if mine is not stock:  # overridden: the parameters Transformers passes still fit
            wanted = list(inspect.signature(stock).parameters)
            have = list(inspect.signature(mine).parameters)
            assert have[: len(wanted)] == wanted[: len(have)], (name, have, wanted)


def test_the_versions_checked_are_recorded():
    from importlib.metadata import version

    for dist, checked in api.CHECKED_AGAINST.items():
        assert version(dist).split(".")[0] == checked.split(".")[0], dist


def _run(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_registration_comes_with_the_import_in_any_order_and_the_hook_then_leaves():
    probe = (
        "import sys\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "hook = any(type(f).__name__ == '_RegisterAfterImport' for f in sys.meta_path)\n"
        "print('zero3' in STRATEGY_REGISTRY, 'zero3' in StrategyRegistry, hook)\n"
    )
    # Our Fabric adapter imported first used to register nothing (a circular import).
    first = "import zero_strategy\nimport zero_strategy.integrations.fabric\n"
    assert _run(first + probe).split()[:2] == ["True", "True"]
    assert _run("import zero_strategy\nimport lightning\n" + probe).split()[:2] == ["True", "True"]
    every = "import zero_strategy, lightning, pytorch_lightning, hydra.core.config_store\n"
    assert _run(every + probe) == "True True False"  # nothing left to register: gone
