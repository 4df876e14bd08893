"""ZeroAccelerator under the environment `accelerate launch` exports for an `accelerate
config` that chose DeepSpeed ZeRO: the same stage and clipping, warnings for what has no
counterpart, explicit settings winning, and Accelerate not setting up DeepSpeed too.
One process, no launcher: the variables are set as `prepare_deepspeed_cmd_env` sets them."""

from __future__ import annotations

import json
import os
import warnings

import pytest

pytest.importorskip("accelerate")

DEEPSPEED_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": ""}
VARIABLES = (
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_CONFIG_DS_FIELDS",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_GRADIENT_CLIPPING",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_CPU",
    "ZERO_STRATEGY_FROM_ACCELERATE_DEEPSPEED",
    "ZERO_STRATEGY_STAGE",
    "ZERO_STRATEGY_CONFIG_FILE",
    "ZERO_STRATEGY_EXPERT_PARALLEL_SIZE",
)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """No launcher variables from outside, each restored afterwards (the code under test
    writes some), and Accelerate's singleton state reset after each test."""
    from accelerate.state import AcceleratorState, GradientState

    for name in VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so restored (or removed) at teardown
        monkeypatch.delenv(name)
    yield monkeypatch
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(monkeypatch, env, **kwargs):
    from zero_strategy.integrations.accelerate import ZeroAccelerator

    for name, value in {**DEEPSPEED_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    return ZeroAccelerator(cpu=True, **kwargs)


def _our_warnings(caught):
    return [str(w.message) for w in caught if "DeepSpeed" in str(w.message)]


def test_stage_2_with_clipping(monkeypatch):
    env = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _accelerator(monkeypatch, env).zero_config
    assert (config.stage, config.gradient_clipping, config.compute_dtype) == (2, 1.0, "fp32")
    assert _our_warnings(caught) == []  # everything asked for is honoured


def test_stage_3_and_accelerates_defaults(monkeypatch):
    """Unset clipping is Accelerate's "auto", which it fills with 1.0; mixed precision and
    accumulation stay Accelerate's own settings, read as without DeepSpeed. Stage 3
    without ZERO3_INIT=false means deepspeed.zero.Init to Accelerate: warned."""
    env = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_MIXED_PRECISION": "fp16",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
    }
    with (
        pytest.warns(UserWarning, match="ZERO3_INIT.*sharded by prepare"),
        pytest.warns(UserWarning, match="mixed_precision='fp16'.* computes in fp32"),
    ):
        accelerator = _accelerator(monkeypatch, env)
    config = accelerator.zero_config
    # fp16 is Accelerate's own setting: on the CPU it runs fp32 (no fp16 autocast there).
    assert accelerator.mixed_precision == "fp16"
    assert (config.stage, config.gradient_clipping, config.compute_dtype) == (3, 1.0, "fp32")
    assert accelerator.gradient_accumulation_steps == 4


def test_config_file_with_auto_values(monkeypatch, tmp_path):
    """A ds_config.json replaces the variables, which only fill its "auto" values."""
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": "auto", "reduce_bucket_size": 5e7},
                "gradient_clipping": 0.5,
                "train_micro_batch_size_per_gpu": "auto",
            }
        )
    )
    env = {
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1",  # fills "auto"
        "ACCELERATE_GRADIENT_CLIPPING": "2.0",  # the file's value stands
    }
    config = _accelerator(monkeypatch, env).zero_config
    assert (config.stage, config.bucket_size, config.gradient_clipping) == (1, 50_000_000, 0.5)


def test_unhonoured_settings_are_named_with_what_happens_instead(monkeypatch):
    from zero_strategy import ZeroConfigError

    env = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _accelerator(monkeypatch, env).zero_config.stage == 3
    (message,) = _our_warnings(caught)
    assert "ACCELERATE_DEEPSPEED_ZERO3_INIT" in message and "sharded by prepare()" in message
    assert "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL" in message
    assert "consolidate the whole model" in message
    # The optimizer's and the parameters' offload are taken, as in a DeepSpeed config; two
    # different directories cannot both be honoured, and the error names the variables.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "/local/nvme")
    config = _accelerator(monkeypatch, {}).zero_config
    assert (config.offload_optimizer, config.offload_dir) == ("disk", "/local/nvme")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "/local/nvme")
    config = _accelerator(monkeypatch, {}).zero_config
    assert (config.offload_params, config.offload_dir) == ("disk", "/local/nvme")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "/elsewhere")
    with pytest.raises(
        ZeroConfigError, match=r"OFFLOAD_PARAM_NVME_PATH=/elsewhere.*Use the same value"
    ):
        _accelerator(monkeypatch, {})


def test_explicit_settings_win(monkeypatch):
    from zero_strategy.integrations.accelerate import ZeroPlugin

    env = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
    }
    plugin = ZeroPlugin(stage=1, options={"gradient_clipping": 0.0})
    config = _accelerator(monkeypatch, env, zero_plugin=plugin).zero_config
    assert (config.stage, config.gradient_clipping) == (1, 0.0)
    monkeypatch.setenv("ZERO_STRATEGY_STAGE", "2")
    config = _accelerator(monkeypatch, env).zero_config
    assert (config.stage, config.gradient_clipping) == (2, 1.0)


def test_accelerate_does_not_set_up_deepspeed(monkeypatch):
    """Without cpu=True a single process under ACCELERATE_USE_DEEPSPEED is Accelerate's
    DEEPSPEED type; ZeroAccelerator consumes the variable first, and a second one in the
    same process still reads the settings."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from zero_strategy.integrations.accelerate import ZeroAccelerator

    env = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_GRADIENT_CLIPPING": "0.5"}
    for name, value in {**DEEPSPEED_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    # The control: the stock Accelerator takes the DeepSpeed path (and, without DeepSpeed
    # installed, stops there asking for it).
    from accelerate.utils import is_deepspeed_available

    if is_deepspeed_available():
        assert Accelerator().distributed_type == DistributedType.DEEPSPEED
    else:
        with pytest.raises(ImportError, match="DeepSpeed is not installed"):
            Accelerator()
    AcceleratorState._reset_state(reset_partial_state=True)
    for _ in range(2):
        accelerator = ZeroAccelerator()
        assert accelerator.distributed_type != DistributedType.DEEPSPEED
        assert accelerator.state.deepspeed_plugin is None
        assert (accelerator.zero_config.stage, accelerator.zero_config.gradient_clipping) == (
            2,
            0.5,
        )
        assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
        AcceleratorState._reset_state(reset_partial_state=True)
