"""Every private name of torch the core relies on (`zero_strategy.private_api`), checked
against the installed torch: a release that moves one fails here, naming it."""

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from zero_strategy import private_api as ti


def test_in_backward_is_true_only_while_autograd_runs():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(ti.in_backward()))
    assert not ti.in_backward()
    y.sum().backward()
    assert seen == [True]


def test_foreach_norm_equals_one_norm_per_tensor():
    tensors = [torch.randn(5), torch.randn(3, 4)]
    norms = ti.foreach_norm(tensors)
    assert [float(n) for n in norms] == [float(t.norm()) for t in tensors]


def test_post_accumulate_grad_hooks_are_listed_and_cleared():
    p = nn.Parameter(torch.ones(3))
    handle = p.register_post_accumulate_grad_hook(lambda t: None)
    assert list(ti.post_accumulate_grad_hooks(p)) == [handle.id]
    ti.clear_post_accumulate_grad_hooks(p)
    assert ti.post_accumulate_grad_hooks(p) == {}


def test_swap_storage_exchanges_memory_in_place():
    a, b = torch.arange(4.0), torch.zeros(0)
    sa, sb = a.untyped_storage(), b.untyped_storage()
    ti.swap_storage(sb, sa)
    assert sa.nbytes() == 0 and sb.nbytes() == 16
    assert torch.tensor([], dtype=torch.float32).set_(sb).tolist() == [0.0, 1.0, 2.0, 3.0]


def _dtensor_follows_its_local_tensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    local = ti.local_tensor(d)
    same = torch.equal(local, d.to_local())
    local.data = torch.full((4,), 7.0)  # what the engine does: the DTensor follows
    return same, d.full_tensor().tolist()


def test_local_tensor_is_the_tensor_a_dtensor_holds():
    """In a rank: a process group made in the pytest process outlives its destruction
    (the DeviceMesh caches keep it) and would be inherited by every later rank."""
    from distributed import run_world

    same, values = run_world(_dtensor_follows_its_local_tensor, 1)[0]
    assert same and values == [7.0] * 4


def test_step_hooks_are_listed_in_torchs_order_and_detected():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    own = opt.register_step_pre_hook(lambda *a: None)
    assert not ti.has_user_step_hooks(opt, own_hooks=1)
    mine = opt.register_step_post_hook(lambda *a: None)
    glob = torch_optimizer.register_optimizer_step_pre_hook(lambda *a: None)
    try:
        pre, post = ti.user_step_hooks(opt, own.id)
        assert pre == list(torch_optimizer._global_optimizer_pre_hooks.values())
        assert post == [opt._optimizer_step_post_hooks[mine.id]]
        assert ti.has_user_step_hooks(opt, own_hooks=1)
    finally:
        glob.remove()
        mine.remove()


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.SGD])
def test_step_without_hooks_steps_as_step_runs_no_hook_and_changes_nothing_global(kind):
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    b.data.copy_(a.data)
    opt_a, opt_b = kind([a], lr=0.1), kind([b], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1)
    calls = []
    opt_b.register_step_pre_hook(lambda *x: calls.append("own"))
    glob = torch_optimizer.register_optimizer_step_post_hook(lambda *x: calls.append("global"))
    globals_before = (
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    try:
        for p in (a, b):
            p.grad = torch.full_like(p, 0.5)
        opt_a.step()
        calls.clear()
        ti.step_without_hooks(opt_b)
        assert calls == []
        assert torch.equal(a, b)
        assert (
            torch_optimizer._global_optimizer_pre_hooks,
            torch_optimizer._global_optimizer_post_hooks,
        ) == globals_before
        with _no_scheduler_order_warning():
            scheduler.step()
    finally:
        glob.remove()


class _no_scheduler_order_warning:
    """The scheduler saw the optimizer step (it warns otherwise)."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.seen = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not [w for w in self.seen if "optimizer.step()" in str(w.message)]


def test_marking_a_model_sharded_turns_on_synced_generation():
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.fsdp import is_fsdp_managed_module

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    )
    assert not is_fsdp_managed_module(model)
    ti.mark_sharded_for_generate(model)
    assert is_fsdp_managed_module(model)
    assert model._fsdp_use_orig_params  # dynamo's reading of the pair: FSDP2's modules


def test_storage_use_count_counts_the_tensors_on_a_storage():
    t = torch.zeros(4)
    alone = ti.storage_use_count(t)
    view = t[:2]  # noqa: F841 (a second tensor on the same memory)
    assert alone is not None and ti.storage_use_count(t) == alone + 1


def test_a_queued_backward_callback_runs_once_when_the_pass_ends():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: (ti.queue_backward_callback(lambda: order.append("end")), None)[1])
    x.register_hook(lambda g: order.append("leaf"))
    y.sum().backward()
    assert order == ["leaf", "end"]


def test_fake_tensors_have_shapes_but_no_memory():
    with ti.fake_tensor_mode():
        t = torch.empty(1000, 1000)
    assert t.shape == (1000, 1000) and type(t).__name__ == "FakeTensor"


def test_direct_parameters_and_persistent_buffers_are_the_modules_own():
    bn = nn.BatchNorm1d(3)
    bn.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert list(ti.direct_parameters(bn)) == ["weight", "bias"]
    names = [name for name, _ in ti.persistent_direct_buffers(bn)]
    assert names == ["running_mean", "running_var", "num_batches_tracked"]
    assert names == [k for k in bn.state_dict() if k not in ("weight", "bias")]


def test_transformers_initialiser_and_experts_names():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        vocab_size=32,
    )
    model = transformers.MixtralForCausalLM(config)
    assert ti.hf_init_weights(model) is not None and ti.hf_init_weights(nn.Linear(2, 2)) is None

    class OwnInit(nn.Linear):  # a layer's own initialiser, called by its model's (MiniCPM-o)
        def _init_weights(self):
            nn.init.zeros_(self.weight)

    assert ti.hf_init_weights(OwnInit(2, 2)) is None
    experts = [m for m in model.modules() if ti.is_hf_experts_module(m)]
    assert experts, "no experts module carries Transformers' marker"
    cfg = experts[0].config
    assert isinstance(ti.experts_implementation(cfg), (str, type(None)))
    ti.select_experts_implementation(cfg, "eager")
    assert ti.experts_implementation(cfg) == "eager"


def test_compiled_wrapper_inner_reads_what_torch_compile_sets():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert ti.compiled_wrapper_inner(model) is None
    assert ti.compiled_wrapper_inner(torch.compile(model)) is model
