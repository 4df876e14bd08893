"""A DeepSpeed ds_config.json read as a ZeroConfig: what maps, what is ignored (and said),
what is refused."""

from __future__ import annotations

import json

import pytest

from zero_strategy import ZeroConfigError, from_deepspeed_config

# A typical Hugging Face / DeepSpeed ZeRO-3 config, "auto" placeholders included.
DS_ZERO3 = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 4,
    "communication_data_type": "fp32",
}


def test_a_zero3_config_maps_field_by_field_and_names_what_it_ignores():
    with pytest.warns(UserWarning) as caught:
        config = from_deepspeed_config(DS_ZERO3)
    assert (config.stage, config.compute_dtype, config.reduce_dtype) == (3, "bf16", "fp32")
    assert config.bucket_size == 50_000_000
    assert config.persistence_threshold == 0  # DeepSpeed's is per parameter: not mapped
    assert (config.max_reuse_distance, config.gradient_clipping) == (1_000_000_000, 1.0)
    message = str(caught[0].message)
    assert "zero_optimization.contiguous_gradients" in message
    assert "zero_optimization.stage3_param_persistence_threshold" in message
    assert "gradient_accumulation_steps (a training-loop setting" in message
    assert "stage3_prefetch_bucket_size" not in message  # "auto": nothing to ignore
    assert "Remove them from the config to silence this" in message


def test_fp16_loss_scaling_keys_map(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "fp16": {
                    "enabled": True,
                    "loss_scale": 0,
                    "initial_scale_power": 12,
                    "loss_scale_window": 500,
                    "min_loss_scale": 2,
                },
                "zero_optimization": {"stage": 2},
            }
        )
    )
    config = from_deepspeed_config(str(path))
    assert (config.stage, config.compute_dtype, config.loss_scale) == (2, "fp16", "dynamic")
    assert (config.initial_loss_scale_power, config.loss_scale_window) == (12, 500)
    assert config.min_loss_scale == 2
    static = from_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.loss_scale == "128.0"


@pytest.mark.parametrize(
    "config,match",
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
            r"offload_param\.device 'gpu'; use 'none', 'cpu' or 'nvme'",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both fp16 and bf16"),
        ({"zero_optimization": {"stage": 4}}, r"ZeroConfig\.stage=4 is invalid"),
    ],
)
def test_what_cannot_be_honoured_is_an_error(config, match):
    with pytest.raises(ZeroConfigError, match=match):
        from_deepspeed_config(config)


def test_offload_to_none_is_accepted():
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}}
    assert from_deepspeed_config(cfg).stage == 3


def test_optimizer_offload_maps_to_the_tiers(tmp_path):
    """nvme is the disk tier (nvme_path its directory, buffer_count and sub_group_size its
    buffers and tiles); cpu is host memory; what cannot be honoured is named."""
    nvme = {
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1e6,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(tmp_path),
                "buffer_count": 5,
                "pin_memory": True,
                "pipeline_read": True,
                "ratio": 0.3,
            },
        },
    }
    with pytest.warns(UserWarning) as caught:
        config = from_deepspeed_config(nvme)
    assert (config.offload_optimizer, config.offload_dir) == ("disk", str(tmp_path))
    assert (config.offload_buffer_count, config.offload_tile_size) == (5, 1_000_000)
    message = str(caught[0].message)
    for key in ("pin_memory", "pipeline_read", "ratio"):
        assert f"zero_optimization.offload_optimizer.{key} (" in message
    cpu = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    assert from_deepspeed_config(cpu).offload_optimizer == "cpu"
    with pytest.raises(ZeroConfigError, match=r"offload_optimizer\.device 'gpu'; use 'none'"):
        from_deepspeed_config({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    no_path = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    with pytest.raises(ZeroConfigError, match=r"offload_dir=None is invalid"):
        from_deepspeed_config(no_path)


def test_the_lightning_strategy_and_the_accelerate_plugin_take_a_ds_config(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    from zero_strategy.integrations.accelerate import ZeroPlugin
    from zero_strategy.integrations.lightning import ZeroStrategy

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}))
    strategy = ZeroStrategy(config=str(path))
    assert (strategy.engine_config.stage, strategy.engine_config.bucket_size) == (2, 1000)
    plugin = ZeroPlugin(config_file=str(path)).resolve("fp16")
    # The file's settings, and Accelerate's mixed_precision where the file says nothing.
    assert (plugin.stage, plugin.bucket_size, plugin.compute_dtype) == (2, 1000, "fp16")


def test_deepspeed_defaults_and_spellings():
    """No stage means DeepSpeed's stage 0; null means DeepSpeed decides; the stage3_ keys
    work without their prefix; the deprecated offload flag maps like the new one."""
    with pytest.warns(UserWarning, match="sets no gradient_clipping"):
        plain = from_deepspeed_config({"fp16": {"enabled": True, "loss_scale_window": 1e3}})
    assert (plain.stage, plain.compute_dtype, plain.loss_scale_window) == (0, "fp16", 1000)
    cfg = {
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "overlap_comm": None, "max_reuse_distance": 5e8},
    }
    config = from_deepspeed_config(cfg)
    assert (config.overlap_comm, config.max_reuse_distance) == (True, 500_000_000)
    deprecated = {
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "cpu_offload_param": True},
    }
    assert from_deepspeed_config(deprecated).offload_params == "cpu"
    with pytest.raises(ZeroConfigError, match="torch_autocast"):
        from_deepspeed_config({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    with pytest.raises(
        ZeroConfigError,
        match=r"From the DeepSpeed config \(zero_optimization\.reduce_bucket_size there\): ZeroConfig\.bucket",
    ):
        from_deepspeed_config({"zero_optimization": {"reduce_bucket_size": 2.5}})


def test_a_precision_the_trainer_overrides_is_named():
    pytest.importorskip("lightning")
    from zero_strategy import ZeroConfig as Config
    from zero_strategy.integrations.strategy_config import compute_dtype_for

    with pytest.warns(UserWarning, match=r"compute_dtype='bf16'.*Trainer\(precision='32-true'\)"):
        assert compute_dtype_for("32-true", Config(compute_dtype="bf16"), "Trainer") == "fp32"
    assert compute_dtype_for("bf16-true", Config(compute_dtype="bf16"), "Trainer") == "bf16"


def test_parameter_offload_maps_to_the_tiers(tmp_path):
    """offload_param: nvme is the disk tier, in the same offload_dir as the optimizer's;
    two different nvme_paths cannot both be honoured; below stage 3 it is ignored (as
    DeepSpeed does), with a warning."""
    both = {
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(tmp_path),
                "buffer_count": 6,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
                "pin_memory": True,
            },
        },
    }
    with pytest.warns(UserWarning) as caught:
        config = from_deepspeed_config(both)
    assert (config.offload_params, config.offload_optimizer) == ("disk", "disk")
    assert (config.offload_dir, config.offload_buffer_count) == (str(tmp_path), 6)
    message = str(caught[0].message)
    for key in ("buffer_size", "max_in_cpu", "pin_memory"):
        assert f"zero_optimization.offload_param.{key} (" in message
    both["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "other")
    with pytest.raises(ZeroConfigError, match=r"offload_param\.nvme_path .*Use the same value"):
        from_deepspeed_config(both)
    cpu = {
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    assert from_deepspeed_config(cpu).offload_params == "cpu"
    stage2 = {
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
    }
    with pytest.warns(UserWarning, match=r"offload_param \(parameters are offloaded at stage 3\)"):
        assert from_deepspeed_config(stage2).offload_params == "none"
