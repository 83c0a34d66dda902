"""A template that writes a space between the role and a reply sent back (`Assistant: {content}`,
as SmolVLM's, Idefics3's and Vicuna's do) while its generation prompt ends at `Assistant:`: a
model that wrote ` than` there returns the text `than` (the detokenizer drops a reply's
leading space), so the reply's ids already hold the template's space. The next turn's prompt
is the generation prompt and those ids (what the cache holds, so the reply is reused in full),
and it reads as the template renders the text (one space, not two). A generation prompt that
ends with the space itself (`Assistant: `) held it before the ids: the next turn keeps it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model
from tests.tolerances import logits_tolerance

COLON_TEMPLATE = (
    "<|im_start|>{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}GENERATION_PROMPT{% endif %}"
)
OPTIONS = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module", params=["Assistant:", "Assistant: "], ids=["colon", "colon-space"])
def colon_model(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("colon") / "model"
    template = COLON_TEMPLATE.replace("GENERATION_PROMPT", request.param)
    return load_model(build_model("llama", path, chat_template=template, seed=5))


def _spaced_reply(runner: Runner) -> tuple[list[dict], object]:
    """The first of a few questions whose greedy reply begins with a leading-space token (a
    random model: found, not assumed), and that reply."""
    tokenizer = runner.tokenizer
    for i in range(20):
        asked = [{"role": "user", "content": f"Tell me {i} things."}]
        reply = runner.generate(asked, **OPTIONS)
        first = tokenizer.decode(reply.tokens[:1])
        if first.startswith(" ") and first.strip() and not reply.text.startswith(" "):
            return asked, reply
    raise AssertionError("no reply of the first 20 questions began with a spaced token")


def test_a_reply_after_the_templates_space_is_reused_in_full(colon_model):
    runner = Runner(colon_model, max_context=512)
    asked, first = _spaced_reply(runner)
    held = runner.cache_tokens
    follow_up = [*asked, {"role": "assistant", "content": first.text}]
    follow_up.append({"role": "user", "content": "More."})
    prompt = runner.encode(follow_up)
    assert prompt[: len(held)] == held
    opened = colon_model.tokenizer.apply_chat_template(asked, add_generation_prompt=True)
    spaced = colon_model.tokenizer.decode(opened).endswith(" ")
    if not spaced:  # else the generation prompt's own space comes before the reply's
        assert "Assistant:  " not in colon_model.tokenizer.decode(prompt)  # one, not two
    chunks = list(runner.stream(follow_up, **OPTIONS, logprobs=0))
    second = chunks[-1].completion
    assert second.cached_tokens == len(held)  # prompt, reply and its end, all reused
    prompt = runner.cache_tokens[: second.prompt_tokens]
    fresh = list(Runner(colon_model, max_context=512).stream(prompt, **OPTIONS, logprobs=0))
    assert [c.token for c in chunks] == [c.token for c in fresh]
    ours = [c.logprob.logprob for c in chunks if c.logprob is not None]
    reference = [c.logprob.logprob for c in fresh if c.logprob is not None]
    np.testing.assert_allclose(ours, reference, atol=logits_tolerance(mx.array(reference)))
