"""Real architectures from Hugging Face transformers train under every stage exactly as
under DDP (no clipping: the same reductions, so the same bits)."""

from __future__ import annotations

import pytest
import torch

from distributed import preload, run_reference_world, run_world
from zero_strategy import ZeroConfig, ZeroEngine

transformers = pytest.importorskip("transformers")
preload(
    *(
        f"transformers.models.{name}.modeling_{name}"
        for name in ("llama", "bert", "mistral", "mixtral", "gpt_neox", "opt", "t5", "gpt2")
    )
)

VOCAB, SEQ = 96, 16
T = transformers

# More architectures, each tiny: encoder-decoder with embeddings shared across units (T5),
# an encoder (BERT), sliding-window and GQA (Mistral), learned positions (OPT), parallel
# residual (GPT-NeoX), and a mixture of experts routed per token (Mixtral).
MORE = {
    "t5": lambda: T.T5ForConditionalGeneration(
        T.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    ),
    "bert": lambda: T.BertForMaskedLM(
        T.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    ),
    "mistral": lambda: T.MistralForCausalLM(
        T.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    ),
    "opt": lambda: T.OPTForCausalLM(
        T.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=SEQ,
            dropout=0.0,
            attention_dropout=0.0,
            word_embed_proj_dim=32,
        )
    ),
    "neox": lambda: T.GPTNeoXForCausalLM(
        T.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    ),
    "mixtral": lambda: T.MixtralForCausalLM(
        T.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    ),
}


def _llama(tied: bool):
    return lambda: T.LlamaForCausalLM(
        T.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=tied,
        )
    )


MODELS = {
    "gpt2": lambda: T.GPT2LMHeadModel(
        T.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ),
    "llama": _llama(tied=False),
    "llama-tied": _llama(tied=True),
    **MORE,
}


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[arch]()


def _train(rank, world, arch, stage, steps=3, checkpointing=None, **config):
    model = build(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if checkpointing is not None:  # activation recomputation, as HF Trainer users enable it
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    if stage == "ddp":  # a Mixtral expert may get no token on a rank
        runner = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=arch == "mixtral"
        )
    else:
        runner = ZeroEngine(model, opt, ZeroConfig(stage=stage, **config))
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1, VOCAB, (4, SEQ), generator=g)[rank * 2 : rank * 2 + 2]
        out = runner(input_ids=ids, labels=ids)
        out.loss.backward()
        if stage == "ddp":
            opt.step()
            opt.zero_grad()
        else:
            runner.step()
            runner.zero_grad()
        losses.append(out.loss.item())
    state = (
        {k: v.detach().clone() for k, v in model.state_dict().items()}
        if stage == "ddp"
        else runner.full_state_dict()
    )
    return losses, state


def _assert_trains_like_ddp(arch: str, stage: int, **kwargs) -> dict:
    """Losses and every trained tensor equal DDP's to the bit; returns the state."""
    ddp_losses, ddp_state = run_reference_world(_train, 2, arch, "ddp")[0]
    losses, state = run_world(_train, 2, arch, stage, **kwargs)[0]
    assert losses == ddp_losses
    for name, value in ddp_state.items():
        if name in state:
            assert torch.equal(state[name], value), name
    return state


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama-tied"])
@pytest.mark.parametrize("stage", [1, 3])
def test_hf_model_matches_ddp(arch, stage):
    state = _assert_trains_like_ddp(arch, stage)
    params = {n for n, _ in build(arch).named_parameters(remove_duplicate=False)}
    assert params <= state.keys()


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gradient_checkpointing_at_stage_3_matches_ddp(arch, checkpointing):
    """Recomputed forwards inside backward gather their units again; the result is DDP's
    (without recomputation) to the bit."""
    _assert_trains_like_ddp(arch, 3, checkpointing=checkpointing)


@pytest.mark.parametrize("arch", sorted(MORE))
def test_more_architectures_match_ddp_at_stage_3(arch):
    _assert_trains_like_ddp(arch, 3)


@pytest.mark.parametrize("arch", ["gpt2", "llama-tied"])
def test_hf_models_train_through_every_disk_tier(arch, tmp_path):
    """Stage 3 with the optimizer state, masters, gradient and parameter shards on disk:
    fp32 equals DDP to the bit; bf16 (the masters in a file of their own) equals the same
    run with everything in memory to the bit."""
    disk = {
        "offload_optimizer": "disk",
        "offload_params": "disk",
        "offload_dir": str(tmp_path),
        "offload_tile_size": 5000,
    }
    _assert_trains_like_ddp(arch, 3, **disk)
    memory = run_world(_train, 2, arch, 3, compute_dtype="bf16")[0]
    offloaded = run_world(_train, 2, arch, 3, compute_dtype="bf16", **disk)[0]
    assert offloaded[0] == memory[0]
    assert all(torch.equal(offloaded[1][k], memory[1][k]) for k in memory[1])
