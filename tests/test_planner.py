"""The planner reproduces the ZeRO paper and predicts this engine's real figures."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_world
from examples.gpt import GPTConfig
from training import local_batch, make_model, make_optimizer
from zero_strategy import ShardSpec, ZeroConfig, ZeroEngine
from zero_strategy.cli import main
from zero_strategy.memory.planner import GB, PlanError, cheapest_stage, count_params, plan


@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, gb):
    """7.5B parameters, 64 ranks, mixed-precision Adam (ZeRO paper, Figure 1)."""
    p = plan(7_500_000_000, 64, stage, "fp16", accounting="zero-paper")
    assert round(p.model_state / GB, 1) == gb


def test_cheapest_stage_that_fits():
    assert (
        cheapest_stage(7_500_000_000, 64, 32 * GB, compute_dtype="fp16", accounting="zero-paper")
        == 1
    )
    assert (
        cheapest_stage(7_500_000_000, 64, 2 * GB, compute_dtype="fp16", accounting="zero-paper")
        == 3
    )
    assert (
        cheapest_stage(7_500_000_000, 64, 1 * GB, compute_dtype="fp16", accounting="zero-paper")
        is None
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": -5}, "params=-5 is invalid"),
        ({"compute_dtype": "fp8"}, "compute_dtype='fp8' is invalid"),
        ({"ep_size": 3}, "ep_size=3 is invalid: it must divide world_size=8"),
        ({"stage": 4}, "stage=4 is invalid"),
        ({"optimizer": "lion"}, "optimizer='lion' is invalid"),
    ],
)
def test_bad_input(kwargs, message):
    args = {"params": 1000, "world_size": 8, "stage": 3, **kwargs}
    with pytest.raises(PlanError, match=message):
        plan(**args)


def _measure(rank, world, stage, dtype, group_size=None):
    model = make_model()
    spec = ShardSpec.contiguous(world, group_size) if group_size else None
    engine = ZeroEngine(
        model,
        make_optimizer(model),
        ZeroConfig(
            stage=stage,
            compute_dtype=dtype,
            reduce_scatter_via_all_reduce=False,
            all_gather_via_broadcast=False,
        ),
        placement=lambda path, module: spec if path == "" else None,
    )
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    m = engine.memory_report()
    state = m["parameters"] + m["master_params"] + m["gradients"] + m["optimizer_state"]
    comm = {k: v["bytes"] for k, v in engine.comm_report().items() if k != "control"}
    return state, comm


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_matches_the_engine_within_2_percent(stage, world, dtype):
    params, root = count_params(make_model())
    predicted = plan(params, world, stage, dtype, root_params=root)
    state, comm = run_world(_measure, world, stage, dtype)[0]
    assert abs(predicted.model_state - state) <= 0.02 * state, (predicted.memory, state)
    if world > 1:
        assert comm.keys() == predicted.comm.keys()
        for kind, value in comm.items():
            assert abs(predicted.comm[kind] - value) <= 0.02 * value, (kind, predicted.comm, comm)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_planner_matches_hybrid_sharding_within_2_percent(stage):
    """The whole model sharded over pairs of a 4-rank world, one copy per pair."""
    params, root = count_params(make_model())
    predicted = plan(params, 4, stage, "fp32", root_params=root, shard_group_size=2)
    state, comm = run_world(_measure, 4, stage, "fp32", 2)[0]
    assert abs(predicted.model_state - state) <= 0.02 * state, (predicted.memory, state)
    assert comm.keys() == predicted.comm.keys()
    for kind, value in comm.items():
        assert abs(predicted.comm[kind] - value) <= 0.02 * value, (kind, predicted.comm, comm)
    with pytest.raises(
        PlanError,
        match=r"shard_group_size=3 is invalid: it must divide world_size=4: use one of \[1, 2, 4\]",
    ):
        plan(params, 4, stage, shard_group_size=3)


def test_estimate_cli_table_and_json(capsys):
    assert (
        main(
            [
                "estimate",
                "--params",
                "7.5B",
                "--world-size",
                "8",
                "--nodes",
                "8",
                "--accounting",
                "zero-paper",
                "--dtype",
                "fp16",
                "--device-memory",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "cheapest stage that fits: 1" in out and "120.000 GB" in out
    assert (
        main(["estimate", "--params", "350M", "--world-size", "4", "--stage", "3", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data[0]["params"] == 350_000_000 and data[0]["stage"] == 3
    assert main(["estimate", "--params=-1B"]) == 1


def test_estimate_from_a_hugging_face_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    cfg.save_pretrained(tmp_path)
    assert (
        main(
            [
                "estimate",
                "--hf-config",
                str(tmp_path),
                "--world-size",
                "2",
                "--stage",
                "3",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())  # tied once
    assert data[0]["params"] == expected


def test_offload_moves_optimizer_state_to_host():
    on_device = plan(13_000_000_000, 8, 2, "bf16")
    offloaded = plan(13_000_000_000, 8, 2, "bf16", offload="optimizer")
    assert offloaded.host_memory["optimizer_state"] == on_device.memory["optimizer_state"]
    assert offloaded.model_state == on_device.model_state - sum(offloaded.host_memory.values())
    with pytest.raises(PlanError, match="offload='nvme' is invalid: use 'none', 'disk'"):
        plan(1000, 1, 0, offload="nvme")


# Views of some 100k elements: the file's rounding of each up to 4 KiB stays below 1%.
WIDER = GPTConfig(vocab_size=512, block_size=16, n_layer=2, n_head=4, n_embd=256)


def _measure_disk(rank, world, stage, directory, **extra):
    model = make_model(cfg=WIDER)
    config = ZeroConfig(stage=stage, offload_optimizer="disk", offload_dir=directory, **extra)
    engine = ZeroEngine(model, make_optimizer(model), config)
    x, y = local_batch(0, 0, rank, world, WIDER)
    engine.backward(engine(x, y))
    engine.step()
    m = engine.memory_report()
    engine.close()
    return m


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16")])
def test_planner_matches_disk_offload_within_2_percent(stage, dtype, tmp_path, capsys):
    """`estimate --offload disk`: the optimizer state on disk (and at stages 2-3 the
    gradients' fp32 shards, in bf16 the fp32 masters), the rest in memory, each within 2%
    of what the engine reports (the file rounds each view and shard up to 4 KiB)."""
    params, root = count_params(make_model(cfg=WIDER))
    predicted = plan(params, 2, stage, dtype, root_params=root, offload="disk")
    m = run_world(_measure_disk, 2, stage, str(tmp_path), compute_dtype=dtype)[0]
    in_memory = m["parameters"] + m["master_params"] + m["gradients"] + m["optimizer_state"]
    assert abs(predicted.model_state - in_memory) <= 0.02 * in_memory, (predicted, m)
    for kind in ("optimizer_state", "gradients", "master_params"):
        measured = m[f"disk_{kind}"]
        assert abs(predicted.disk.get(kind, 0) - measured) <= 0.02 * measured, (kind, predicted, m)
    assert (stage >= 2) == ("gradients" in predicted.disk) == (m["gradients"] == 0)
    assert (dtype == "bf16") == ("master_params" in predicted.disk) == (m["disk_master_params"] > 0)
    assert main(["estimate", "--params", "7B", "--world-size", "8", "--stage", "3",
                 "--offload", "disk"]) == 0  # fmt: skip
    assert "offloaded to disk per rank:" in capsys.readouterr().out


@pytest.mark.parametrize(("world", "dtype"), [(2, "fp32"), (1, "bf16")])
def test_planner_matches_parameter_offload_within_2_percent(world, dtype, tmp_path):
    """`estimate --offload disk+params` (stage 3): the optimizer state, the parameter
    shards (with their masters in bf16) and the gradients' shards on disk; one process
    keeps stage 3 then."""
    params, root = count_params(make_model(cfg=WIDER))
    predicted = plan(params, world, 3, dtype, root_params=root, offload="disk+params")
    m = run_world(
        _measure_disk, world, 3, str(tmp_path), offload_params="disk", compute_dtype=dtype
    )[0]
    # In memory: the views' step counts alone (4-byte scalars), all else in the files.
    assert m["parameters"] == m["master_params"] == m["gradients"] == 0
    assert predicted.model_state == 0 and 0 < m["optimizer_state"] < 1000
    for kind in ("parameters", "master_params", "optimizer_state", "gradients"):
        measured = m[f"disk_{kind}"]
        assert abs(predicted.disk.get(kind, 0) - measured) <= 0.02 * measured, (kind, predicted, m)
    assert (dtype == "bf16") == ("master_params" in predicted.disk)
    with pytest.raises(PlanError, match="offload='disk\\+params' is invalid at stage 2"):
        plan(params, world, 2, offload="disk+params")


def _one_step_across_nodes(rank, world, path, config):
    """One training step of the Hugging Face model on 4 ranks as 2 nodes x 2: the bytes
    this rank received from the other node, by the engine's count."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(**config))
    ids = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(rank))
    engine.reset_comm_report()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    report = engine.comm_report()
    engine.close()
    return sum(v["across_node_bytes"] for k, v in report.items() if k != "control")


def test_estimate_predicts_the_bytes_across_nodes_of_a_real_run(tmp_path, capsys):
    """`zero-strategy estimate --nodes 2` gives, for stage 3, what one training step of
    that model on 2 nodes x 2 ranks receives from the other node, to the byte (the
    hierarchy and int8 weights here; tests/test_two_level.py covers the other settings)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    cfg.save_pretrained(tmp_path)
    argv = ["estimate", "--hf-config", str(tmp_path), "--world-size", "2", "--nodes", "2"]
    argv += ["--stage", "3", "--dtype", "fp32", "--secondary-partition-size", "2"]
    assert main([*argv, "--quantized-weights", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)[0]["across_node"]
    config = {"stage": 3, "secondary_partition_size": 2, "quantized_weights": True}
    measured = run_world(_one_step_across_nodes, 4, str(tmp_path), config, timeout=180)
    assert measured == [predicted["gather"] + predicted["reduce"]] * 4
    assert main(argv) == 0
    assert "received from other nodes per step and rank:" in capsys.readouterr().out
