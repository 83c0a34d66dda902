"""Codex CLI (`codex exec`) with a custom provider on the Responses API: it answers, and the
next turn (`codex exec resume --last`) reuses the first turn's K/V."""

from __future__ import annotations

from tests.agents.conftest import agent_cli, run_agent

ACCESS = r"POST /v1/responses 200 .* prompt=(\d+) cached=(\d+) "


def test_codex_answers_twice_and_the_second_turn_hits_the_cache(agent_server, access_log, tmp_path):
    codex = agent_cli("codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        'model = "mlxkv-test"\n'
        'model_provider = "mlxkv"\n'
        "[model_providers.mlxkv]\n"
        'name = "mlxkv"\n'
        f'base_url = "{agent_server.url}/v1"\n'
        'wire_api = "responses"\n'
    )
    env = {"CODEX_HOME": str(home), "HOME": str(tmp_path)}
    exec_ = [codex, "exec", "--skip-git-repo-check"]
    assert run_agent([*exec_, "say hello"], env, work).stdout.strip()
    first = access_log(ACCESS, count=1)
    assert run_agent([*exec_, "resume", "--last", "and again"], env, work).stdout.strip()
    second = access_log(ACCESS, count=2)
    assert int(second.group(2)) >= int(first.group(1))  # the first turn's prompt, reused
