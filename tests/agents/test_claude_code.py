"""Claude Code (`claude -p`), as the README's setup has users run it: it answers, `--continue`
reuses the first turn's K/V, and a new session reuses the system prompt (its per-session
billing header is not part of the prompt)."""

from __future__ import annotations

from mlxkv import Runner
from tests.agents.conftest import WINDOW_TOKENS, agent_cli, run_agent
from tests.server.conftest import serve

ACCESS = r"POST /v1/messages 200 .* prompt=(\d+) cached=(\d+) "


def test_claude_code_answers_continues_and_shares_the_system_prompt(
    agent_server, access_log, monkeypatch, tmp_path
):
    claude = agent_cli("claude")
    prompts = []
    stream = agent_server.runner.stream

    def recording(prompt, *args, **kwargs):
        prompts.append(prompt)
        return stream(prompt, *args, **kwargs)

    monkeypatch.setattr(agent_server.runner, "stream", recording)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": agent_server.url,
        "ANTHROPIC_API_KEY": "unused",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    # Claude Code asks for more max_tokens than the window holds: the error in its own
    # wording makes it retry with fewer (a 400, then a 200), never a failure.
    assert run_agent([claude, "-p", "say hello"], env, work).stdout.strip()
    first = access_log(ACCESS, count=1)

    run_agent([claude, "-p", "--continue", "and again"], env, work)
    assert int(access_log(ACCESS, count=2).group(2)) >= int(first.group(1))  # all of turn 1

    run_agent([claude, "-p", "a new session"], env, work)
    system = prompts[-1][0]
    assert system["role"] == "system" and "x-anthropic-billing-header" not in system["content"]
    system_tokens = len(agent_server.runner.encode([system]))
    assert int(access_log(ACCESS, count=3).group(2)) >= 0.8 * system_tokens


def test_claude_code_continues_after_a_restart_from_the_disk_tier(
    agent_model, access_log, tmp_path
):
    """`mlxkv serve` keeps a disk tier by default: a session continued after the server
    restarts on the same cache directory reuses the whole first turn from disk, as the
    process that served it would."""
    claude = agent_cli("claude")
    work = tmp_path / "work"
    work.mkdir()
    disk = tmp_path / "kv"
    env = {
        "HOME": str(tmp_path),
        "ANTHROPIC_API_KEY": "unused",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    before = Runner(agent_model, max_context=WINDOW_TOKENS, cache_dir=disk)
    with serve(before) as served:
        run_agent([claude, "-p", "say hello"], {**env, "ANTHROPIC_BASE_URL": served.url}, work)
        first = access_log(ACCESS, count=1)
    before.close()  # the disk writes end here, as when `mlxkv serve` stops

    restarted = Runner(agent_model, max_context=WINDOW_TOKENS, cache_dir=disk)
    with serve(restarted) as served:
        url = {"ANTHROPIC_BASE_URL": served.url}
        run_agent([claude, "-p", "--continue", "and again"], {**env, **url}, work)
        assert int(access_log(ACCESS, count=2).group(2)) >= int(first.group(1))  # all of turn 1
    restarted.close()
