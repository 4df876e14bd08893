"""Hydra/OmegaConf: `trainer/strategy=zero3` in a Hydra app (lightning-hydra-template style).

`import zero_strategy` registers in Hydra's ConfigStore (at once if Hydra is imported,
else when it is):

- group `trainer/strategy`, names `zero1`, `zero2`, `zero3`: a `_target_` of Lightning's
  `ZeroStrategy` with every `ZeroConfig` field, typed, so OmegaConf rejects a wrong type
  when the config is composed and `ZeroConfig` a wrong value when it is instantiated:
  `python train.py trainer/strategy=zero3 trainer.strategy.prefetch_depth=2`;
- `zero_config` (group `zero`): the `ZeroConfig` schema, for apps that keep engine
  settings in their own config node.

A `trainer` config that names `strategy: zero3` as a string works too (the Lightning
registry); the group is for overriding fields from the command line.
"""

from __future__ import annotations

import dataclasses

from zero_strategy import ZeroConfig

STRATEGY_TARGET = "zero_strategy.integrations.lightning.ZeroStrategy"
STRATEGY_GROUP = "trainer/strategy"


def strategy_node(stage: int) -> type:
    """A structured config class: the ZeroConfig fields (inherited, so types and defaults
    stay ZeroConfig's own), stage preset, plus the `_target_` Hydra instantiates."""
    return dataclasses.make_dataclass(
        f"Zero{stage}StrategyConf",
        [
            ("stage", int, dataclasses.field(default=stage)),
            ("_target_", str, dataclasses.field(default=STRATEGY_TARGET)),
        ],
        bases=(ZeroConfig,),
    )


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for stage in (1, 2, 3):
        store.store(group=STRATEGY_GROUP, name=f"zero{stage}", node=strategy_node(stage))
    store.store(group="zero", name="zero_config", node=ZeroConfig)
