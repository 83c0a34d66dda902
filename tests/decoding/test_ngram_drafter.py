"""The n-gram drafter's index, built in slices when a draft is asked for, proposes what a
brute-force search of the text proposes."""

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
