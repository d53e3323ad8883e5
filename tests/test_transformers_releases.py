"""dspark-hf calls the installed transformers release by its own names (CI runs this suite on the oldest release
we declare and on the newest): 5.24 renamed the KV cache argument from `past_key_values` to `cache`."""

import inspect
import warnings

import torch
import transformers
from transformers import DynamicCache, LlamaForCausalLM

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import AutoScheduled, FullBlock
from dspark_hf.internals import CACHE_ARG, with_cache
from dspark_hf.costs.profile import profile_sps


def test_the_cache_goes_by_the_name_the_installed_models_take():
    assert CACHE_ARG in inspect.signature(LlamaForCausalLM.forward).parameters
    assert CACHE_ARG in inspect.signature(transformers.GenerationMixin.prepare_inputs_for_generation).parameters


def test_our_own_calls_raise_no_deprecation_warning(transformers_log):
    """Decoding (greedy and sampled, batched, the default policy with its cost measurement) and the cost profile:
    nothing of ours uses a name the installed release has deprecated."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    draft = tiny_draft(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, assistant_model=draft,
                        verification_policy=FullBlock(), do_sample=False)
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, assistant_model=draft, do_sample=True,
                        verification_policy=AutoScheduled(progress=False))
        profile_sps(target, rows=[1], max_tokens_per_row=2, context=8, warmup=0, repeats=1, draft=draft)
    deprecated = [r.getMessage() for r in transformers_log if "deprecat" in r.getMessage().lower()]
    assert not deprecated


def test_a_cache_passed_to_a_forward_under_the_installed_name_is_filled():
    target = tiny_target("llama")
    cache = DynamicCache()
    target(input_ids=torch.ones(1, 3, dtype=torch.long), **with_cache(cache), use_cache=True)
    assert cache.get_seq_length() == 3
