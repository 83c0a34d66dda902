"""Codex CLI (`codex exec`) with a custom provider on the Responses API, and `codex exec --oss`
on the Ollama API: each answers, and the next turn (`codex exec resume --last`) reuses the
first turn's K/V."""

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


def test_codex_oss_on_the_ollama_api_answers_twice_with_the_cache(
    agent_server, access_log, tmp_path
):
    """`--oss --local-provider ollama`: Codex checks `/api/version` (0.13.4 or newer), lists
    `/api/tags`, pulls the model, then speaks Responses on the base URL it is given."""
    codex = agent_cli("codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        "CODEX_HOME": str(home),
        "HOME": str(tmp_path),
        "CODEX_OSS_BASE_URL": f"{agent_server.url}/v1",
    }
    model = agent_server.app.state.mlxkv.model_name
    exec_ = [codex, "exec", "--oss", "--local-provider", "ollama", "-m", model]
    exec_ += ["--skip-git-repo-check"]
    assert run_agent([*exec_, "say hello"], env, work).stdout.strip()
    first = access_log(ACCESS, count=1)
    assert run_agent([*exec_, "resume", "--last", "and again"], env, work).stdout.strip()
    second = access_log(ACCESS, count=2)
    assert int(second.group(2)) >= int(first.group(1))
