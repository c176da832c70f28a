"""Decode steps feed a model what transformers' generate feeds it (model.steps.step_input_ids):
the new token to most models, the whole sequence to one whose forward slices the cached part off
itself (CPM-Ant)."""

from __future__ import annotations

import pytest
import torch

from pytest_layerparity.model.steps import hf_step, step_input_ids, teacher_forced


def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {
        "llama": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1},
        "cpmant": {"hidden_size": 32, "dim_ff": 64, "num_attention_heads": 2, "dim_head": 16, "prompt_length": 4},
    }[model_type]
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, vocab_size=64, **sizes)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("model_type", ["llama", "cpmant"])
def test_teacher_forced_decode_steps_give_the_logits_generate_gives(model_type, device):
    """The prompt, then each greedy token with the model's own cache: the logits of
    transformers' greedy generate, step by step (before, CPM-Ant's decode steps failed with a
    shape error: its forward was handed the new token alone; on CUDA, Llama's with a device
    mismatch: its preparation gives the ids where the cache is)."""
    model = _tiny(model_type).to(device)
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        generated = model.generate(
            prompt.to(device), max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    tokens = generated.sequences[:, prompt.shape[-1] :].cpu()
    logits = teacher_forced(hf_step(model), prompt, tokens[:, :2], device=device)
    assert logits.shape == (1, 10, 64)
    torch.testing.assert_close(logits[:, 7:], torch.stack(generated.logits, dim=1).float().cpu(), rtol=1e-5, atol=1e-5)


def test_a_decode_step_takes_the_new_token_or_the_whole_sequence_as_generate_gives_it():
    from pytest_layerparity.store.callspec import cache_argument, returned_cache

    sequence = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    for model_type, fed in (("llama", sequence[:, -1:]), ("cpmant", sequence)):
        model = _tiny(model_type)
        name = cache_argument(model.forward, "past_key_values")
        with torch.no_grad():
            cache = returned_cache(model(input_ids=sequence[:, :-1], use_cache=True))
        assert torch.equal(step_input_ids(model, sequence, cache, name), fed), model_type


def test_a_preparation_that_gives_no_input_ids_ending_the_sequence_leaves_the_new_token():
    sequence = torch.arange(6).reshape(1, 6)

    class Odd(torch.nn.Module):
        def __init__(self, prepared):
            super().__init__()
            self.prepared = prepared

        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            if self.prepared is None:
                raise TypeError("takes other arguments")
            return self.prepared

    for prepared in (None, {}, {"input_ids": None}, {"input_ids": torch.tensor([[7]])}, {"input_ids": sequence[0]}):
        assert torch.equal(step_input_ids(Odd(prepared), sequence, None, "cache"), sequence[:, -1:])
    assert torch.equal(step_input_ids(Odd({"input_ids": sequence[:, 2:]}), sequence, None, "cache"), sequence[:, 2:])
