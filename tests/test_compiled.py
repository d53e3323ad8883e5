"""The fast path: ``cache_implementation="static"`` compiles DSpark's steps where plain generate() would compile its
own (here, on the CPU, with inductor's CPU backend and `CompileConfig._compile_all_devices`), decodes exactly as the
eager path does, and compiles once: later calls of the same sizes reuse the graphs.

The lossless tests run on this path too: CI runs them again with DSPARK_TEST_FAST_PATH=1 (see conftest.fast_path).
"""

import pytest
import torch

from conftest import FAMILIES, cpu_compile_config, left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import FixedLength, FullBlock, SSDConfig
from test_generation_greedy import eos_inside_a_block, oracle, other_family, plain


def fast(target, draft, ids, mask, **kw):
    kw.setdefault("verification_policy", FullBlock())
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, assistant_model=draft,
                           cache_implementation="static", compile_config=cpu_compile_config(),
                           return_dict_in_generate=True, **kw)


@pytest.mark.slow  # inductor compiles every verification width and the draft's block for each family: 45-80 s each
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_steps_decode_as_plain_generate_and_later_calls_reuse_them(family):
    target = tiny_target(family)
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(3)
    free, eos = eos_inside_a_block(target, ids, mask)  # row 0 ends inside a block, the others go on
    reference = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    out = fast(target, oracle(target, draft, free, mask, 0.3), ids, mask, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    assert any(0 < r.accepted < 4 for rows in out.rounds for r in rows), "partly accepted blocks were verified"

    # the first call compiles every verification width; later ones, shorter prompts and policies that verify other
    # lengths alike, compile nothing more
    assert torch.equal(fast(target, draft, ids, mask, max_new_tokens=30).sequences,
                       plain(target, ids, mask, max_new_tokens=30))
    other_ids, other_mask = left_padded_prompts(3, length=7, seed=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (1, 2):
            again = fast(target, draft, other_ids, other_mask, max_new_tokens=30,
                         verification_policy=FixedLength(length))
            assert torch.equal(again.sequences, plain(target, other_ids, other_mask, max_new_tokens=30))


def test_a_target_whose_rows_cannot_keep_their_own_offsets_is_refused_compiling_in_one_line():
    target = other_family("bloom")  # ALiBi biases come from a 2D mask
    ids, mask = left_padded_prompts(2)
    with pytest.raises(ValueError, match="cache_implementation='static' compiles DSpark's steps, but BloomForCausalLM "
                                         r"cannot keep its rows at their own offsets \(bloom builds ALiBi"):
        fast(target, tiny_draft(target), ids, mask, max_new_tokens=6)
    eager = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                            assistant_model=tiny_draft(target), verification_policy=FullBlock())
    assert torch.equal(eager, plain(target, ids, mask, max_new_tokens=6))  # the eager path still runs


def test_ssd_with_compiled_steps_is_refused_in_one_line():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    with pytest.raises(ValueError, match="ssd= speculates in a thread of its own"):
        fast(target, tiny_draft(target), ids, mask, max_new_tokens=6, ssd=SSDConfig())


def test_a_step_torch_cannot_compile_says_so_in_one_line_naming_the_target():
    def broken_backend(graph, example_inputs, **options):
        raise NotImplementedError("no kernel for this op")

    config = cpu_compile_config()
    config.backend = broken_backend
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    with pytest.raises(RuntimeError, match="torch.compile could not compile the target's verification forward for "
                                           "LlamaForCausalLM "
                                           r"\(NotImplementedError: no kernel for this op\): decode without "
                                           "cache_implementation='static'") as error:
        target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                        assistant_model=tiny_draft(target), cache_implementation="static", compile_config=config,
                        verification_policy=FullBlock())
    assert "\n" not in str(error.value)


def test_disable_compile_or_no_static_cache_keeps_the_eager_steps(monkeypatch):
    from dspark_hf.generation import steps

    compiled = []
    monkeypatch.setattr(steps, "_compiled", lambda fn, config: compiled.append(fn) or fn)
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    for kw in (dict(cache_implementation="static", disable_compile=True),  # as plain generate() reads them
               dict(cache_implementation="static"),  # off CUDA, transformers compiles only when told to
               dict(compile_config=cpu_compile_config())):  # no static cache: nothing compiles
        target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                        assistant_model=tiny_draft(target), **kw)
    assert compiled == []
    target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                    assistant_model=tiny_draft(target), cache_implementation="static",
                    compile_config=cpu_compile_config())
    assert [fn.__name__ for fn in compiled] == ["_verify", "_draft"]


def test_a_length_limit_the_static_cache_cannot_hold_is_refused_in_one_line():
    """max_new_tokens=10**12 ("until EOS") decodes eagerly in buffers that grow; the fast path preallocates for the
    limit, as plain generate()'s static cache does, and says so where that cannot fit."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    with pytest.raises(MemoryError, match=r"preallocates the decoding state .*max_new_tokens=1000000000000.*lower "
                                          "max_new_tokens, or decode without cache_implementation='static'"):
        fast(target, tiny_draft(target), ids, mask, max_new_tokens=10**12)


def test_the_compiled_state_is_sized_as_transformers_sizes_its_static_cache_and_only_grows():
    """Attention reads every slot of a compiled state, so it holds what the call needs (the prompt and every new
    token), or `max_cache_len` tokens where the call gives it, exactly as plain generate()'s static cache does (a
    verification's padding writes on the last slot, which no kept token occupies); a later call that fits reuses it
    (its graphs too), a longer one gets a larger state, which is kept."""
    from transformers import GenerationConfig

    from dspark_hf.generation.steps import Steps

    target = tiny_target("llama")
    draft = tiny_draft(target)
    config = GenerationConfig(cache_implementation="static", compile_config=cpu_compile_config())
    steps = Steps.for_call(target, draft, config)
    state = steps.state(batch_size=2, prompt_length=9, max_new=30)
    assert state.slots == 9 + 30
    steps.release(state)
    assert steps.state(2, 7, 30) is state  # fits: reused
    steps.release(state)
    longer = steps.state(2, 9, 60)
    assert longer.slots == 9 + 60
    steps.release(longer)
    assert steps.state(2, 9, 30) is longer  # the pool keeps the larger
    config.max_cache_len = 200
    assert Steps.for_call(target, draft, config).state(2, 9, 30).slots == 200
