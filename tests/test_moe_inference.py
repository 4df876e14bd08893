"""Expert-parallel generation: experts stay on their expert-parallel rank, tokens travel by
all-to-all, and what each rank generates is what one process holding every expert
generates, token for token (fp32, greedy; and sampled from the same generator). Ranks
asking for different lengths still finish: every rank runs the longest request's forwards.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distributed import run_world
from examples.gpt import GPT, GPTConfig
from zero_strategy import ZeroConfig, ZeroEngine

MOE = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, n_experts=4)
BATCH, PROMPT = 3, 5


def model_for(ep_size: int | None) -> GPT:
    torch.manual_seed(0)
    return GPT(replace(MOE, ep_size=ep_size)).eval()


def prompts(rank: int) -> torch.Tensor:
    return torch.randint(
        MOE.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(rank)
    )


def request(rank: int, sample: bool) -> dict:
    """Rank r asks for 6 + 4r tokens: the ranks' requests differ in length."""
    kwargs = {"max_new_tokens": 6 + 4 * rank, "do_sample": sample}
    if sample:
        kwargs.update(temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(10 + rank))
    return kwargs


def _generate(rank, world, stage, sample):
    model = model_for(None)
    engine = ZeroEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeroConfig(stage=stage, expert_parallel_size=world),
    )
    model.eval()
    held = sum(layer.moe.num_local for layer in model.blocks)
    out = model.generate(prompts(rank), **request(rank, sample))
    comm = engine.comm_report()
    return out, held, comm


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("stage", [1, 3])
def test_expert_parallel_generation_equals_one_process(stage, sample):
    reference = model_for(1)
    ranks = run_world(_generate, 2, stage, sample)
    for rank, (out, held, comm) in enumerate(ranks):
        want = reference.generate(prompts(rank), **request(rank, sample))
        assert out.shape == (BATCH, PROMPT + 6 + 4 * rank)
        assert torch.equal(out, want)
        assert held == 2 * 2  # 2 of the 4 experts in each of the 2 layers
        assert comm["all_to_all"]["calls"] > 0


def test_cached_decoding_equals_recomputing_the_whole_sequence():
    """The KV cache changes nothing: each step's logits equal those of the full sequence."""
    model = model_for(1)
    out = model.generate(prompts(0), 8)
    with torch.no_grad():
        full = model(out[:, :-1])
    assert torch.equal(full[:, PROMPT - 1 :].argmax(-1), out[:, PROMPT:])


def test_a_request_past_the_block_size_is_refused():
    with pytest.raises(ValueError, match="exceeds block_size=32"):
        model_for(1).generate(prompts(0), 40)


def _mixtral():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(config).eval()


def _hf_generate(rank, world, stage):
    model = _mixtral()
    ZeroEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeroConfig(stage=stage, expert_parallel_size=2),
    )
    model.eval()
    # No synced_gpus: generate() keeps the ranks in step by itself.
    return model.generate(prompts(rank), max_new_tokens=6 + 4 * rank, do_sample=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_hugging_face_moe_generation_equals_one_process(stage):
    reference = _mixtral()
    for rank, out in enumerate(run_world(_hf_generate, 2, stage)):
        want = reference.generate(prompts(rank), max_new_tokens=6 + 4 * rank, do_sample=False)
        assert torch.equal(out, want)


def _predict(rank, world):
    import lightning as L
    from lightning_helpers import quiet_trainer

    from zero_strategy.integrations.lightning import ZeroStrategy

    class Generator(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model_for(None)

        def predict_step(self, batch, batch_idx):
            (prompt,) = batch
            return prompt, self.model.generate(prompt, max_new_tokens=6 + 4 * self.global_rank)

    data = torch.cat([prompts(r) for r in range(world)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH)
    trainer = quiet_trainer(world, ZeroStrategy(stage=3, expert_parallel_size=2))
    (out,) = trainer.predict(Generator(), loader)
    return out


def test_lightning_predict_generates_expert_parallel():
    reference = model_for(1)
    for rank, (prompt, out) in enumerate(run_world(_predict, 2)):
        assert out.shape == (BATCH, PROMPT + 6 + 4 * rank)
        assert torch.equal(out, reference.generate(prompt, 6 + 4 * rank))
