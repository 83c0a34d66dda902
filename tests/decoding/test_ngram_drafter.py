"""The n-gram drafter's index (the prompt's n-grams hashed and sorted when a draft is first asked
for, those of the tokens after it in a dictionary) proposes what a brute-force search of the
text proposes."""

import random

import pytest

from mlxkv.decoding.drafts import MAX_NGRAM, MIN_NGRAM, NgramDrafter


def _searched(text: list[int], limit: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest matching suffix n-gram."""
    for n in range(min(MAX_NGRAM, len(text)), MIN_NGRAM - 1, -1):
        suffix = text[len(text) - n :]
        for start in range(len(text) - n - 1, -1, -1):  # occurrences followed by a token
            if text[start : start + n] == suffix:
                return text[start + n : start + n + limit]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_proposals_equal_a_search_of_the_text(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    text = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
    drafter = NgramDrafter(text)
    for _ in range(80):
        if rng.random() < 0.6:
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            drafter.extend(new)
            text += new
        else:
            limit = rng.randrange(1, 6)
            assert drafter.propose(limit).tokens == _searched(text, limit)
            assert drafter.can_propose() == bool(_searched(text, 1))


@pytest.mark.parametrize("seed", range(3))
def test_a_long_prompt_with_a_large_vocabulary_proposes_as_a_search(seed):
    """Ids past 16 bits and a prompt where short n-grams recur many times: the sorted
    hashes must give the latest occurrence, and the tokens generated after it must win."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(2**20) for _ in range(rng.randrange(2, 7))] for _ in range(40)]
    text = [t for _ in range(300) for t in rng.choice(phrases)]
    drafter = NgramDrafter(text)
    for _ in range(30):
        limit = rng.randrange(1, 8)
        assert drafter.propose(limit).tokens == _searched(text, limit)
        new = rng.choice(phrases)[: rng.randrange(1, 4)]
        drafter.extend(new)
        text += new


def test_a_draft_ends_before_an_id_that_is_no_token():
    """A vision prompt's image placeholders (ids past the vocabulary) are never drafted: the
    acceptance rule would read their probability off the end of the logits."""
    placeholder = 1_000_000
    text = [5, 6, 7, placeholder, placeholder + 1, 8, 5, 6]
    assert NgramDrafter(text).propose(4).tokens == [7, placeholder, placeholder + 1, 8]
    assert NgramDrafter(text, vocab_size=100).propose(4).tokens == [7]
    starts_with_one = [5, 6, placeholder, 7, 5, 6]
    assert NgramDrafter(starts_with_one, vocab_size=100).propose(4).tokens == []
