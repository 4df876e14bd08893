"""pytest plugin: the maintainers' DDP tests run with zero-strategy in DDP's place.

Loaded with `-p swap_plugin`. With `ZERO_SWAP_STAGE=1|2|3` set, before any test module is
imported:

* Lightning and Fabric: every strategy-registry entry whose class is exactly
  `DDPStrategy` ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook",
  "ddp_find_unused_parameters_true", ...) is re-registered as zero-strategy's strategy
  with that stage and the entry's `start_method`; DDP-only options (find_unused_parameters)
  are dropped. Since "auto" with several devices resolves to the name "ddp", it follows.
  A `DDPStrategy(...)` instance of exactly that class passed to `Trainer`/`Fabric` is
  turned, in place (the test may keep and inspect it), into the ZeRO strategy built from
  its accelerator, devices, cluster environment, checkpoint IO, precision plugin, backend
  and start method, in the connector's `_check_config_and_set_final_flags` (see
  `_become`). Subclasses of `DDPStrategy` written by the tests, and `DDPStrategy` objects
  used without a Trainer/Fabric, stay DDP.
* Accelerate: `accelerate.Accelerator` (and `accelerate.accelerator.Accelerator`) become
  `ZeroAccelerator`, whose stage comes from `ZERO_STRATEGY_STAGE` (set here from
  `ZERO_SWAP_STAGE`).

With `ZERO_SWAP_CUDA_ON_CPU=1` (the runner's `--cuda-on-cpu`), Lightning's tests gated on
CUDA devices are re-targeted to the CPU, as far as that goes: `RunIf(min_cuda_gpus=N)`
no longer skips, and a Trainer's or Fabric's `accelerator="gpu"`/`"cuda"` (or a
`CUDAAccelerator`) becomes the CPU, with a device list as that many processes. What a
test does with CUDA itself (`.cuda()`, CUDA memory, fp16 autocast) fails under every
strategy alike; the report compares each ZeRO stage with ddp re-targeted the same way.

Whatever the stage, each construction of a DDP-family strategy or an Accelerator is
appended to `$ZERO_SWAP_MARKS` (a file) with the running test's id
(`$PYTEST_CURRENT_TEST`, or `$ZERO_SWAP_TEST_ID` set by accelerate_shim.py), so the report can tell
a test that exercised the strategy from one that never built it (forked and spawned
workers inherit the variable and write there too).
"""

from __future__ import annotations

import functools
import os
from typing import Any

STAGE = int(os.environ["ZERO_SWAP_STAGE"]) if os.environ.get("ZERO_SWAP_STAGE") else None
# With ZERO_SWAP_STATE_DICT_TYPE=full, Lightning's and Fabric's ZeRO strategies write one
# checkpoint file (state_dict_type="full") instead of the default sharded directory.
OPTIONS = (
    {"state_dict_type": os.environ["ZERO_SWAP_STATE_DICT_TYPE"]}
    if os.environ.get("ZERO_SWAP_STATE_DICT_TYPE")
    else {}
)


def _mark(kind: str, obj: object) -> None:
    path = os.environ.get("ZERO_SWAP_MARKS")
    test = os.environ.get("ZERO_SWAP_TEST_ID") or os.environ.get("PYTEST_CURRENT_TEST", "")
    test = test.rsplit(" (", 1)[0]
    if path and test:
        with open(path, "a") as f:
            f.write(f"{test}\t{kind}\t{type(obj).__name__}\n")


def _record_inits(cls: type, kind: str) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def recording_init(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not getattr(self, "_swap_marked", False):  # once, for the outermost class
            self._swap_marked = True
            _mark(kind, self)

    cls.__init__ = recording_init


def _swap_registry(registry: Any, ddp: type, zero: type, stage: int) -> None:
    for name, entry in list(registry.items()):
        if entry["strategy"] is ddp:
            registry.register(
                name,
                zero,
                description=f"{entry['description']} -> ZeRO stage {stage} (swap_plugin)",
                override=True,
                stage=stage,
                start_method=entry["init_params"].get("start_method", "popen"),
                **OPTIONS,
            )


def _swap_instances(connector: type, ddp: type, convert: Any) -> None:
    check = connector._check_config_and_set_final_flags

    @functools.wraps(check)
    def swapping_check(self, strategy, *args: Any, **kwargs: Any):
        if type(strategy) is ddp:
            convert(strategy)
        return check(self, strategy, *args, **kwargs)

    connector._check_config_and_set_final_flags = swapping_check


_MISSING = object()


def _become(obj: Any, zero: Any, plain: Any) -> None:
    """Turns the test's `DDPStrategy` object into the ZeRO strategy `zero` in place, so a
    test that keeps it (`strategy._launcher`, `strategy.model`) sees what the Trainer uses.
    `plain` is a `DDPStrategy` built from the same arguments as `zero`: what `zero`'s
    constructor sets that `plain`'s does not, or sets to another type, and the DDP kwargs it
    drops, overlay the object's state (the rest, e.g. a rank the test set by hand, stays);
    then the object takes `zero`'s class. Helpers built around `zero` are re-pointed."""
    state = vars(obj)
    for key, value in vars(zero).items():
        base = vars(plain).get(key, _MISSING)
        if key == "_ddp_kwargs" or base is _MISSING or type(base) is not type(value):
            state[key] = value
            if getattr(value, "strategy", None) is zero:
                value.strategy = obj
    obj.__class__ = type(zero)


def _converter(ddp_cls: type, zero_cls: type, stage: int, precision_arg: str) -> Any:
    def convert(ddp: Any) -> None:
        precision = ddp._precision_plugin if precision_arg == "precision_plugin" else ddp._precision
        args = {
            "accelerator": ddp._accelerator,
            "parallel_devices": ddp.parallel_devices,
            "cluster_environment": ddp.cluster_environment,
            "checkpoint_io": ddp._checkpoint_io,
            precision_arg: precision,
            "process_group_backend": ddp._process_group_backend,
            "start_method": ddp._start_method,
        }
        _become(ddp, zero_cls(stage=stage, **args, **OPTIONS), ddp_cls(**args))

    return convert


def _install_lightning(stage: int | None) -> None:
    try:
        from lightning.fabric import strategies as fabric_strategies
        from lightning.fabric.connector import _Connector
        from lightning.pytorch import strategies as pl_strategies
        from lightning.pytorch.trainer.connectors.accelerator_connector import (
            _AcceleratorConnector,
        )
    except ImportError:
        return
    _record_inits(pl_strategies.DDPStrategy, "lightning")
    _record_inits(fabric_strategies.DDPStrategy, "fabric")
    if stage is None:
        return
    import zero_strategy  # noqa: F401  (registers zero1..zero3)
    from zero_strategy.integrations.fabric import ZeroFabricStrategy
    from zero_strategy.integrations.lightning import register

    zero_pl = register("lightning.pytorch")
    pl_ddp, fabric_ddp = pl_strategies.DDPStrategy, fabric_strategies.DDPStrategy
    to_zero_pl = _converter(pl_ddp, zero_pl, stage, "precision_plugin")
    to_zero_fabric = _converter(fabric_ddp, ZeroFabricStrategy, stage, "precision")
    _swap_registry(pl_strategies.StrategyRegistry, pl_strategies.DDPStrategy, zero_pl, stage)
    _swap_registry(
        fabric_strategies.STRATEGY_REGISTRY,
        fabric_strategies.DDPStrategy,
        ZeroFabricStrategy,
        stage,
    )
    _swap_instances(_AcceleratorConnector, pl_strategies.DDPStrategy, to_zero_pl)
    _swap_instances(_Connector, fabric_strategies.DDPStrategy, to_zero_fabric)


def _install_accelerate(stage: int | None) -> None:
    try:
        import accelerate
        import accelerate.accelerator
    except ImportError:
        return
    _record_inits(accelerate.Accelerator, "accelerate")
    if stage is None:
        return
    os.environ["ZERO_STRATEGY_STAGE"] = str(stage)
    from zero_strategy.integrations.accelerate import ZeroAccelerator

    accelerate.Accelerator = ZeroAccelerator
    accelerate.accelerator.Accelerator = ZeroAccelerator


def _without_cuda_gate(reasons: Any) -> Any:
    @functools.wraps(reasons)
    def cpu_reasons(*args: Any, min_cuda_gpus: int = 0, **kwargs: Any):
        return reasons(*args, **kwargs)

    return cpu_reasons


def _cpu_devices(devices: Any) -> Any:
    """A CUDA device list as a number of CPU processes."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return devices


def _to_cpu(connector: type) -> None:
    from lightning.fabric.accelerators import CUDAAccelerator

    init = connector.__init__

    @functools.wraps(init)
    def cpu_init(self, *args: Any, **kwargs: Any) -> None:
        accelerator = kwargs.get("accelerator", "auto")
        if isinstance(accelerator, CUDAAccelerator) or accelerator in ("gpu", "cuda"):
            kwargs["accelerator"] = "cpu"
            kwargs["devices"] = _cpu_devices(kwargs.get("devices", "auto"))
        init(self, *args, **kwargs)

    connector.__init__ = cpu_init


def _retarget_cuda() -> None:
    import lightning.fabric.utilities.testing as fabric_testing
    import lightning.pytorch.utilities.testing as pl_testing
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    for module in (fabric_testing, pl_testing):
        module._runif_reasons = _without_cuda_gate(module._runif_reasons)
    _to_cpu(_AcceleratorConnector)
    _to_cpu(_Connector)


def install(suite: str, stage: int | None = STAGE) -> None:
    if suite in ("lightning", "all") and os.environ.get("ZERO_SWAP_CUDA_ON_CPU") == "1":
        _retarget_cuda()
    if suite in ("lightning", "all"):
        _install_lightning(stage)
    if suite in ("accelerate", "all"):
        _install_accelerate(stage)


def pytest_configure(config: Any) -> None:
    install(os.environ.get("ZERO_SWAP_SUITE", "all"))
