"""Hydra: `trainer/strategy=zero1..zero3` from the ConfigStore, typed fields, the example
app under Lightning's launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

hydra = pytest.importorskip("hydra")
pytest.importorskip("lightning")

import zero_strategy  # noqa: E402, F401  (registers the configs)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "examples" / "configs")


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_config_store_has_the_strategies_and_the_schema():
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    assert store.list("trainer/strategy") == ["zero1.yaml", "zero2.yaml", "zero3.yaml"]
    assert store.list("zero") == ["zero_config.yaml"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overrides_reach_the_strategy(stage):
    from hydra.utils import instantiate

    cfg = _compose(
        f"trainer/strategy=zero{stage}",
        "trainer.strategy.bucket_size=1000",
        "trainer.strategy.unit_module_classes=[Block]",
        "trainer.strategy.expert_parallel_size=2",
        "trainer.strategy.tensor_parallel_size=2",
        "trainer.devices=1",
        "hydra.runtime.output_dir=/tmp",
    )
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ == "ZeroStrategy"
    config = strategy.engine_config
    assert (config.stage, config.bucket_size, config.unit_module_classes) == (
        stage,
        1000,
        ["Block"],
    )
    assert config.expert_parallel_size == 2
    assert config.tensor_parallel_size == 2


def test_a_wrong_type_fails_at_composition_naming_the_field():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as info:
        _compose("trainer.strategy.prefetch_depth=two")
    assert "prefetch_depth" in str(info.value.__cause__ or info.value)


def test_a_wrong_value_fails_at_instantiation_with_the_fix():
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = _compose("trainer.strategy.stage=5")
    with pytest.raises(InstantiationException, match=r"ZeroConfig\.stage=5 is invalid"):
        instantiate(cfg.trainer.strategy)


def test_the_hydra_example_trains_on_two_ranks(tmp_path):
    """Lightning's launcher re-runs the Hydra script for rank 1 with the same overrides."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(ROOT / "examples" / "train_hydra.py"),
        "trainer/strategy=zero2",
        "trainer.max_steps=3",
        "+trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage 2: final loss" in result.stdout
    assert "MEMBER: 2/2" in result.stderr + result.stdout  # two ranks took part
