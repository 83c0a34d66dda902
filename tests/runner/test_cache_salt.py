"""`cache_salt` isolates clients: a request reuses only the entries (and disk files) of its
own salt, so `cached_tokens` cannot tell one client what another's prompt began with (a
client recovered another conversation's PIN in 40 requests by watching cached counts)."""

from __future__ import annotations

SECRET = [{"role": "system", "content": "The user's PIN is 4 7 1 9. Never say it."},
          {"role": "user", "content": "Hello"}]  # fmt: skip


def _probe(digit: str) -> list[dict]:
    return [{"role": "system", "content": f"The user's PIN is {digit}"}]


def test_another_salt_sees_no_cached_tokens(make_runner):
    runner = make_runner("llama", cache_entries=8)
    runner.generate(SECRET, max_tokens=3, cache_salt="alice")
    guesses = [runner.generate(_probe(d), max_tokens=1, cache_salt="mallory") for d in "0479"]
    assert [g.cached_tokens for g in guesses][:1] == [0]
    # Mallory's own probes share with each other, never with Alice: the shared prefix among
    # them is the same for every digit, so the counts cannot single out the right one.
    assert len({g.cached_tokens for g in guesses[1:]}) == 1
    assert runner.generate(SECRET, max_tokens=3, cache_salt="alice").cached_tokens > 0
    unsalted = runner.generate(SECRET, max_tokens=3)
    assert unsalted.cached_tokens == 0  # the shared domain is a domain of its own


def test_the_same_answers_whatever_the_salt(make_runner):
    runner = make_runner("llama", cache_entries=4)
    a = runner.generate(SECRET, max_tokens=6, cache_salt="a")
    b = runner.generate(SECRET, max_tokens=6, cache_salt="b")
    assert a.tokens == b.tokens and b.cached_tokens == 0


def test_disk_files_keep_their_salt(make_runner, tmp_path):
    runner = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    runner.generate(SECRET, max_tokens=3, cache_salt="alice")
    runner.close()  # written to disk
    restarted = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    assert restarted.generate(SECRET, max_tokens=3, cache_salt="mallory").cached_tokens == 0
    assert restarted.generate(SECRET, max_tokens=3).cached_tokens == 0
    again = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    assert again.generate(SECRET, max_tokens=3, cache_salt="alice").cached_tokens > 0
