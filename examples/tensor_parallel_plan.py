"""The standard tensor-parallel plan for a Hugging Face Llama-style decoder (Llama,
Mistral, Qwen2, ...): in every block, attention's q/k/v and the MLP's gate/up
projections column-wise, o and down row-wise, so each block's matmuls are split over
the tensor dimension and the activations between blocks are whole. Apply it on the
tensor dimension of the mesh, then hand the model to ZeRO:

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
    apply_llama_plan(model, mesh["tensor"])
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), config, device_mesh=mesh)
"""

from __future__ import annotations

from torch import nn


def llama_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def apply_llama_plan(model: nn.Module, tensor_mesh) -> nn.Module:
    """The plan on every block of `model.model.layers` (a ...ForCausalLM)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer, tensor_mesh, llama_plan())
    return model
