"""Every private name of torch the core uses, in one place, each checked against the
installed torch by `tests/test_private_api.py`.

A private name can change in any release. Here each use says what it is for and why no
public route does it, and the oldest torch this package runs on is checked at import, so
that a torch that moved a name fails in one test that names it, not deep in a step.
Lightning's, Fabric's, Accelerate's and Transformers' private names are the integrations'
(`zero_strategy.integrations.private_api`): the core never imports them.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch.optim import optimizer as torch_optimizer
from torch.utils._pytree import tree_flatten  # noqa: F401 (re-exported)

# The torch these names were checked against, and the oldest torch the package runs on:
# the engine calls torch.distributed's `all_gather_single` and `reduce_scatter_single`,
# the names torch 2.13 gave to `all_gather_into_tensor` / `reduce_scatter_tensor`.
CHECKED_AGAINST = "2.13.0"
MIN_TORCH = "2.13"


def check_torch_version(version: str = torch.__version__) -> None:
    """On an older torch the first collective would fail deep inside a training step;
    failing at import names the fix instead."""
    if torch.torch_version.TorchVersion(version) < MIN_TORCH:
        raise ImportError(
            f"zero-strategy needs torch>={MIN_TORCH} (for torch.distributed.all_gather_single "
            f"and reduce_scatter_single), but torch {version} is installed. Upgrade it: "
            f"pip install 'torch>={MIN_TORCH}'."
        )


# ---------------------------------------------------------------- autograd
def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a module hook
    fired by activation recomputation must not start a new forward's work. Torch has no
    public query for it (`torch._C._current_graph_task_id`)."""
    return torch._C._current_graph_task_id() != -1


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """One L2 norm per tensor in one pass: `torch._foreach_norm`, what
    `clip_grad_norm_(foreach=True)` itself calls (no public multi-tensor norm)."""
    return list(torch._foreach_norm(tensors, ord))


def post_accumulate_grad_hooks(p: torch.Tensor) -> dict[int, Callable]:
    """The post-accumulate-grad hooks registered on `p`, by handle id. A DTensor
    parameter whose contents a module conversion swapped loses its hooks' wiring; they are
    registered again from this list (`Tensor._post_accumulate_grad_hooks`)."""
    return dict(getattr(p, "_post_accumulate_grad_hooks", None) or {})


def clear_post_accumulate_grad_hooks(p: torch.Tensor) -> None:
    """Forget `p`'s hook list, so that registering again wires a new one."""
    p._post_accumulate_grad_hooks = None


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # looked up once


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many references hold `tensor`'s storage (`torch._C._storage_Use_Count` on the
    storage's `_cdata`): a gradient whose memory nothing else holds is reduced in place.
    None where torch has no such count (then the caller copies)."""
    if _STORAGE_USE_COUNT is None:
        return None
    return _STORAGE_USE_COUNT(tensor.untyped_storage()._cdata)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the current backward pass ends, on autograd's engine
    (`Variable._execution_engine.queue_callback`, as DDP and FSDP do): no public call
    runs something once after every gradient of a pass is computed."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def fake_tensor_mode():
    """Tensors with shapes and dtypes but no memory (`torch._subclasses.FakeTensorMode`):
    the skeleton of a `torch.save` file written before its data, which
    `torch.serialization.skip_data(materialize_fake_tensors=True)` documents."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


# ---------------------------------------------------------------- modules
def direct_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A module's own parameter slots by name, `None` entries included
    (`Module._parameters`): what its `state_dict` hooks write and read."""
    return module._parameters


def persistent_direct_buffers(module: torch.nn.Module):
    """(name, buffer) of a module's own buffers that its state dict holds: torch keeps
    persistence in `Module._non_persistent_buffers_set`, with no public query short of
    `state_dict()` (which would run the engine's own hooks)."""
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield name, buf


def compiled_wrapper_inner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside `torch.compile(model)`'s wrapper (`OptimizedModule._orig_mod`,
    where Lightning and Accelerate also read it), or None for any other module. Nothing is
    compiled before `torch._dynamo` is loaded, so an unloaded one is not loaded here."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod
    return None


# ---------------------------------------------------------------- Transformers
# Checked against Transformers 5.24.0. The core loads and shards Hugging Face models.
def hf_init_weights(module: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """A Hugging Face model's per-module initialiser (`PreTrainedModel._init_weights`),
    or that of a model following its convention (nanoGPT's), or None (a layer's own
    `_init_weights()`, taking no module): the public
    `init_weights()` initialises the whole model, and a meta-built model is initialised
    one unit at a time."""
    init = getattr(module, "_init_weights", None)
    if not callable(init):
        return None
    try:  # `_init_weights(module)`; a layer's own `_init_weights()` (MiniCPM-o's merger)
        inspect.signature(init).bind(module)  # is left to its model's, which calls it
    except (TypeError, ValueError):
        return None
    return init


def is_hf_experts_module(module: torch.nn.Module) -> bool:
    """Whether `use_experts_implementation` decorated this experts module (it sets
    `_is_expert_parallel`; Transformers has no public marker)."""
    return hasattr(module, "_is_expert_parallel")


def experts_implementation(config) -> str | None:
    """The experts implementation a Transformers config selects
    (`config._experts_implementation`)."""
    return config._experts_implementation


def select_experts_implementation(config, name: str) -> None:
    """Route one config's experts through the registered implementation `name`
    (`set_experts_implementation()` is model-wide and changes the model's own config)."""
    config._experts_implementation = name


# ---------------------------------------------------------------- storage
def swap_storage(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages in place (`UntypedStorage._swap_data_ptr_`):
    a freed unit's gather memory is handed to the next gather of that size without a
    new allocation, while tensors autograd saved keep pointing at their storage."""
    a._swap_data_ptr_(b)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as the tensor it holds (`DTensor._local_tensor`): the
    engine points its `.data` into the flat buffers. `to_local()` returns a new view
    through autograd, whose `.data` is not the DTensor's."""
    return p._local_tensor


def mark_sharded_for_generate(module: torch.nn.Module) -> None:
    """Mark a Transformers model as sharded, so that its `generate()` defaults to
    `synced_gpus=True`: the attribute torch's FSDP sets on the modules it manages
    (`_is_fsdp_managed_module`), which Transformers reads to turn it on. Transformers has
    no public switch for models sharded by another library. FSDP2 sets
    `_fsdp_use_orig_params` beside it, and so does this: dynamo reads the pair, and
    without the second it breaks the graph at the module ("FSDP with
    use_orig_params=False"); with it, dynamo takes the parameters as inputs, as for
    FSDP2's modules."""
    module._is_fsdp_managed_module = True
    module._fsdp_use_orig_params = True


# ---------------------------------------------------------------- optimizer step hooks
def user_step_hooks(
    optimizer: torch.optim.Optimizer, own_hook: int, with_global: bool = True
) -> tuple[list[Callable], list[Callable]]:
    """The pre- and post-step hooks `optimizer.step()` would run, in torch's order
    (global then own pre-hooks, own then global post-hooks), less the engine's guard
    (handle id `own_hook`); with `with_global=False` its own alone. Read only; torch has
    no public listing of them."""
    pre = [
        *(torch_optimizer._global_optimizer_pre_hooks.values() if with_global else ()),
        *(h for k, h in optimizer._optimizer_step_pre_hooks.items() if k != own_hook),
    ]
    post = [
        *optimizer._optimizer_step_post_hooks.values(),
        *(torch_optimizer._global_optimizer_post_hooks.values() if with_global else ()),
    ]
    return pre, post


def has_user_step_hooks(optimizer: torch.optim.Optimizer, own_hooks: int) -> bool:
    """Whether a step hook other than the engine's `own_hooks` ones is registered, on
    this optimizer or for every optimizer: a step that bypasses `optimizer.step()` (the
    fused kernel) would skip it."""
    return (
        len(optimizer._optimizer_step_pre_hooks) > own_hooks
        or bool(optimizer._optimizer_step_post_hooks)
        or bool(torch_optimizer._global_optimizer_pre_hooks)
        or bool(torch_optimizer._global_optimizer_post_hooks)
    )


def step_without_hooks(optimizer: torch.optim.Optimizer) -> None:
    """One `optimizer.step()` with no step hook run, global or its own: a step taken a
    tile at a time runs the user's hooks once around all the tiles instead. Torch wraps
    every optimizer class's `step` once (`Optimizer.profile_hook_step`, marked `hooked`)
    in a function that runs the hooks; its `__wrapped__` is the class's own step (with its
    no-grad decorator). Nothing global is changed. The step is marked as taken for the LR
    schedulers (`_opt_called`), as the instance's own `step` would."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)
    mark_stepped(optimizer)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell an LR scheduler that `optimizer` stepped (it warns about a scheduler step
    before any optimizer step otherwise): what the scheduler's wrapper of `step` sets, for
    steps the engine takes without calling it (fused, or a tile at a time)."""
    optimizer._opt_called = True


check_torch_version()
