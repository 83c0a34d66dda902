"""Stored responses and conversations kept in a state directory (`ServerConfig.state_dir`;
`mlxkv serve` keeps it in its disk tier's directory) outlive a restart, through the real
`openai` client: before, a restarted server answered a `previous_response_id`, an
`item_reference` and a conversation's id with 400s and 404s (the AI SDK's and the Agents SDK's
sessions failed after it). Replies after the restart are checked against a fresh Runner's
log-probabilities; the files are checked to be what memory holds after every change."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import openai
import pytest

from mlxkv import Runner
from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.conversations import Conversations, checked_items
from mlxkv.server.responses_api.history import ResponseHistory
from mlxkv.server.responses_api.saved import SavedFiles

from .conftest import held_worker, serve

MAX_TOKENS = 6
LOGPROBS = {"include": ["message.output_text.logprobs"], "temperature": 0}
ASK = {"model": "m", "max_output_tokens": MAX_TOKENS, **LOGPROBS}
HI = {"role": "user", "content": "Hi there"}


def _logprobs(response) -> list[float]:
    return [token.logprob for token in response.output[0].content[0].logprobs]


def _fresh_logprobs(fresh_runner, messages: list[dict]) -> list[float]:
    chunks = fresh_runner().stream(messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    return [chunk.logprob.logprob for chunk in chunks if chunk.logprob is not None]


def _files(directory: Path, prefix: str) -> set[str]:
    return {path.stem for path in directory.glob(f"{prefix}*.json")}


def test_what_was_stored_is_answered_after_a_restart(loaded_tiny, fresh_runner, tmp_path):
    state = tmp_path / "state"
    with serve(Runner(loaded_tiny("llama"), max_context=1024), state_dir=state) as served:
        client = served.openai()
        first = client.responses.create(**ASK, input="Once upon a time")
        second = client.responses.create(**ASK, input="And then", previous_response_id=first.id)
        conversation = client.conversations.create(items=[HI], metadata={"topic": "greetings"})
        turn = client.responses.create(**ASK, input="Hello", conversation=conversation.id)
        items = client.conversations.items.list(conversation.id, order="asc").data
    assert _files(state, "resp_") == {first.id, second.id, turn.id}
    assert _files(state, "conv_") == {conversation.id}

    with serve(Runner(loaded_tiny("llama"), max_context=1024), state_dir=state) as served:
        client = served.openai()
        assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
        assert client.responses.input_items.list(second.id).data[0].content[0].text == "And then"
        assert client.conversations.retrieve(conversation.id).metadata == {"topic": "greetings"}
        after = client.conversations.items.list(conversation.id, order="asc").data
        assert [item.model_dump() for item in after] == [item.model_dump() for item in items]

        chained = client.responses.create(**ASK, input="At last", previous_response_id=second.id)
        asked = [
            {"role": "user", "content": "Once upon a time"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then"},
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "At last"},
        ]
        assert _logprobs(chained) == pytest.approx(_fresh_logprobs(fresh_runner, asked), abs=1e-4)

        referenced = client.responses.create(
            **ASK,
            input=[
                {"role": "user", "content": "Once upon a time"},
                {"type": "item_reference", "id": first.output[0].id},
                {"role": "user", "content": "At last"},
            ],
        )
        asked = [*asked[:2], asked[-1]]
        assert _logprobs(referenced) == pytest.approx(
            _fresh_logprobs(fresh_runner, asked), abs=1e-4
        )

        continued = client.responses.create(**ASK, input="Again", conversation=conversation.id)
        asked = [HI, {"role": "user", "content": "Hello"}]
        asked += [{"role": "assistant", "content": turn.output_text}]
        asked += [{"role": "user", "content": "Again"}]
        assert _logprobs(continued) == pytest.approx(_fresh_logprobs(fresh_runner, asked), abs=1e-4)


def test_the_files_are_what_memory_holds(tmp_path):
    """After each change: a response dropped for room, a response deleted, a conversation
    grown, an item removed, a conversation deleted; then read back as they were."""
    saved = SavedFiles.open(tmp_path)
    history = ResponseHistory(max_responses=2, saved=saved)
    held = Conversations(max_conversations=2, saved=saved)
    ids = [f"resp_{n:032x}" for n in range(3)]
    for response_id in ids:
        _put(history, response_id)
    kept = held.create([HI], {"k": "v"}, salt="tenant")
    dropped = held.create([], {}, None).id
    held.add(kept.id, checked_items([{"role": "user", "content": "more"}]), "tenant")
    held.create([], {}, None)  # `kept` was used last: `dropped` goes for room
    held.remove_item(kept.id, kept.items[0]["id"], "tenant")
    history.delete(ids[1], None)
    saved.close()  # its writes done

    assert _files(tmp_path, "resp_") == {ids[2]}
    conversations = _files(tmp_path, "conv_")
    assert kept.id in conversations and dropped not in conversations and len(conversations) == 2
    again = SavedFiles.open(tmp_path)
    read = ResponseHistory(saved=again)
    assert read.response(ids[2], None) == history.response(ids[2], None)
    assert read.get(ids[2], None) == history.get(ids[2], None)
    assert read.item(f"msg_{ids[2]}", None) is not None and read.item(f"msg_{ids[0]}", None) is None
    read_back = Conversations(saved=again).get(kept.id, "tenant")
    assert (read_back.items, read_back.metadata) == (kept.items, {"k": "v"})
    again.close()


def _put(history: ResponseHistory, response_id: str, previous: str | None = None) -> None:
    output = [{"id": f"msg_{response_id}", "type": "message", "role": "assistant"}]
    messages = [{"role": "user", "content": response_id}, {"role": "assistant", "content": "ok"}]
    response = {"id": response_id, "object": "response", "status": "completed", "output": output}
    history.put(messages, response, [], salt=None, previous=previous)


def test_a_chain_read_back_shares_its_messages(tmp_path):
    saved = SavedFiles.open(tmp_path)
    history = ResponseHistory(saved=saved)
    _put(history, "resp_" + "a" * 32)
    _put(history, "resp_" + "b" * 32, previous="resp_" + "a" * 32)
    saved.close()
    again = SavedFiles.open(tmp_path)
    read = ResponseHistory(saved=again)
    again.close()
    assert read._stored.chars == history._stored.chars  # measured as when they were put
    first, second = (read._stored.get(f"resp_{c * 32}").messages for c in "ab")
    assert second[0] is first[0]


def test_one_server_keeps_a_directory(tmp_path, caplog):
    first = SavedFiles.open(tmp_path)
    with caplog.at_level(logging.WARNING, "mlxkv.server.responses_api.saved"):
        assert SavedFiles.open(tmp_path) is None
    assert "in memory only" in caplog.text
    first.close()
    SavedFiles.open(tmp_path).close()  # let go: another may take it


def test_a_damaged_file_is_said_and_left(tmp_path, caplog):
    """A torn or foreign file is one warning and stays; a temporary a killed server left is
    removed; files named otherwise are not touched."""
    torn = tmp_path / f"resp_{'1' * 32}.json"
    torn.write_text('{"version": 1, "id": "resp_')
    other_id = tmp_path / f"conv_{'2' * 32}.json"
    other_id.write_text(json.dumps({"version": 1, "id": f"conv_{'3' * 32}"}))
    newer = tmp_path / f"conv_{'4' * 32}.json"
    newer.write_text(json.dumps({"version": 99, "id": f"conv_{'4' * 32}"}))
    left = tmp_path / f".resp_{'5' * 32}.json.tmp"
    left.write_text("{")
    mine = tmp_path / "notes.json"
    mine.write_text("{}")
    with caplog.at_level(logging.WARNING, "mlxkv.server.responses_api.saved"):
        saved = SavedFiles.open(tmp_path)
        ResponseHistory(saved=saved)
        Conversations(saved=saved)
        saved.close()
    assert caplog.text.count("left as it is") == 3
    assert torn.exists() and other_id.exists() and newer.exists() and mine.exists()
    assert not left.exists()


def test_without_a_directory_nothing_is_written(loaded_tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        client = served.openai()
        client.responses.create(**ASK, input="Hello")
        assert served.app.state.saved is None
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_be_made_keeps_memory(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, "mlxkv.server.responses_api.saved"):
        assert SavedFiles.open(blocked / "state") is None
    assert "kept in memory only" in caplog.text


def test_what_is_answered_is_in_its_file(loaded_tiny, tmp_path, monkeypatch):
    """Each write and removal held back a while: the file is as the answer says as the
    client reads it (streamed: at response.completed), so a server killed right after keeps
    what it was told; each route that changes what is kept."""
    for name in ("_write", "_remove"):
        work = getattr(SavedFiles, name)

        def late(self, argument, work=work):
            threading.Event().wait(0.5)  # an answer sent before the work came first
            work(self, argument)

        monkeypatch.setattr(SavedFiles, name, late)
    state = tmp_path / "state"

    def kept(key: str) -> dict | None:
        path = state / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    with serve(Runner(loaded_tiny("llama"), max_context=1024), state_dir=state) as served:
        client = served.openai()
        made = client.responses.create(**ASK, input="Hello")
        assert kept(made.id)["response"]["id"] == made.id
        with client.responses.stream(**ASK, input="Hello") as events:
            for event in events:
                if event.type == "response.completed":
                    assert kept(event.response.id) is not None
        client.responses.delete(made.id)
        assert kept(made.id) is None
        conversation = client.conversations.create(items=[HI])
        assert len(kept(conversation.id)["items"]) == 1
        (added,) = client.conversations.items.create(conversation.id, items=[HI]).data
        assert len(kept(conversation.id)["items"]) == 2
        client.conversations.update(conversation.id, metadata={"k": "v"})
        assert kept(conversation.id)["metadata"] == {"k": "v"}
        client.conversations.items.delete(added.id, conversation_id=conversation.id)
        assert len(kept(conversation.id)["items"]) == 1
        client.conversations.delete(conversation.id)
        assert kept(conversation.id) is None


def test_a_background_response_is_read_back_as_it_ended(loaded_tiny, tmp_path):
    """Made, cancelled, or being made when its server was killed (its files copied then):
    read back completed, cancelled (with its input items), failed; none of the last two
    continued. Before, a restart forgot all three (404)."""
    state, killed = tmp_path / "state", tmp_path / "killed"
    with serve(Runner(loaded_tiny("llama"), max_context=1024), state_dir=state) as served:
        client = served.openai()
        with held_worker(served) as release:  # neither can start yet
            made = client.responses.create(**ASK, input="Once upon a time", background=True)
            cut = client.responses.create(**ASK, input="Hello", background=True)
            shutil.copytree(state, killed)  # what a kill -9 now leaves
            assert client.responses.cancel(cut.id).status == "cancelled"
            release.set()
            for _ in client.responses.retrieve(made.id, stream=True):  # to its end
                pass
        made = client.responses.retrieve(made.id)
        assert made.status in ("completed", "incomplete")

    with serve(Runner(loaded_tiny("llama"), max_context=1024), state_dir=state) as served:
        client = served.openai()
        assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
        assert client.responses.retrieve(cut.id).status == "cancelled"
        assert client.responses.cancel(cut.id).status == "cancelled"  # as OpenAI's: again
        (item,) = client.responses.input_items.list(cut.id).data
        assert item.content[0].text == "Hello"
        with pytest.raises(openai.BadRequestError, match="it was cancelled"):
            client.responses.create(**ASK, input="Then", previous_response_id=cut.id)
        with pytest.raises(openai.BadRequestError, match="no longer kept"):
            client.responses.retrieve(cut.id, stream=True)

    with serve(Runner(loaded_tiny("llama"), max_context=1024), state_dir=killed) as served:
        client = served.openai()
        for response_id in (made.id, cut.id):
            lost = client.responses.retrieve(response_id)
            assert (lost.status, lost.error.code) == ("failed", "server_error")
            assert "stopped before" in lost.error.message
        with pytest.raises(openai.BadRequestError, match="has ended"):
            client.responses.cancel(made.id)


def test_a_record_of_another_shape_changes_nothing(tmp_path, caplog):
    """Valid JSON of this version and id, but not of its kind's shape: one warning, the file
    left, nothing held (review23: a response was held half-read, and its eviction then
    failed whichever request made room; a conversation's bad items failed every add)."""
    bad_output = f"resp_{'1' * 32}"
    response = {"id": bad_output, "status": "completed", "output": [{"type": "message"}]}
    record = {"salt": None, "previous": None, "messages": [], "input_items": []}
    (tmp_path / f"{bad_output}.json").write_text(
        json.dumps({"version": 1, "id": bad_output, **record, "response": response})
    )
    other_id = f"resp_{'2' * 32}"
    response = {"id": f"resp_{'3' * 32}", "status": "completed", "output": []}
    (tmp_path / f"{other_id}.json").write_text(
        json.dumps({"version": 1, "id": other_id, **record, "response": response})
    )
    bad_items = f"conv_{'4' * 32}"
    conversation = {"created_at": 1, "metadata": {}, "salt": None, "items": ["x"]}
    (tmp_path / f"{bad_items}.json").write_text(
        json.dumps({"version": 1, "id": bad_items, **conversation})
    )
    with caplog.at_level(logging.WARNING, "mlxkv.server.responses_api.saved"):
        saved = SavedFiles.open(tmp_path)
        history = ResponseHistory(max_responses=1, saved=saved)
        held = Conversations(saved=saved)
    assert caplog.text.count("left as it is") == 3
    assert history.response(bad_output, None) is None and history.response(other_id, None) is None
    with pytest.raises(ApiError):
        held.get(bad_items, None)
    for n in range(2):  # room made: nothing half-read to evict
        _put(history, f"resp_{n:032x}")
    saved.close()
    assert {path.stem for path in tmp_path.glob("*.json")} == {
        bad_output,
        other_id,
        bad_items,
        f"resp_{1:032x}",
    }


def test_a_write_that_fails_leaves_no_older_state(tmp_path, monkeypatch, caplog):
    """A full disk: the conversation's older file goes, so a restart forgets it rather than
    read back what it held before (its answer said the items were added)."""
    saved = SavedFiles.open(tmp_path)
    held = Conversations(saved=saved)
    conversation = held.create([HI], {}, None)
    saved.close()
    assert (tmp_path / f"{conversation.id}.json").exists()
    saved = SavedFiles.open(tmp_path)
    held = Conversations(saved=saved)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, "mlxkv.server.responses_api.saved"):
        held.add(conversation.id, checked_items([HI]), None)
        saved.close()
    assert "No space left" in caplog.text and "will not read it back" in caplog.text
    assert not list(tmp_path.glob("*conv_*"))  # neither its file nor a temporary


def test_only_their_owner_reads_the_files(tmp_path):
    saved = SavedFiles.open(tmp_path / "state")
    Conversations(saved=saved).create([HI], {}, None)
    saved.close()
    saved.close()  # once: a second close does nothing
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    (written,) = (tmp_path / "state").glob("conv_*.json")
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


def _unfinished(response_id: str, status: str = "queued") -> dict:
    return {"id": response_id, "object": "response", "status": status, "output": []}


def test_a_background_response_s_file_is_written_over_never_removed_first(tmp_path, monkeypatch):
    """Its state at its start, then as it ended: the file was removed, then written again, and
    a kill between the two left none (review23c: a 404 after the restart, not `failed`)."""
    removed: list[str] = []
    remove = SavedFiles._remove
    monkeypatch.setattr(
        SavedFiles, "_remove", lambda self, key: (removed.append(key), remove(self, key))
    )
    saved = SavedFiles.open(tmp_path)
    history = ResponseHistory(saved=saved)
    response_id = f"resp_{'a' * 32}"
    history.put_unfinished(_unfinished(response_id), [], None)
    _put(history, response_id)  # it ended as a turn
    history.put_unfinished(_unfinished(response_id, "failed"), None, None)  # a stop after it
    saved.close()
    assert removed == []
    kept = json.loads((tmp_path / f"{response_id}.json").read_text())
    assert kept["response"]["status"] == "completed" and kept["messages"]


def test_a_background_response_too_large_to_store_is_not_left_queued(tmp_path):
    """Its reply past the bound: its state at its start stayed, `queued` for good (and read
    back `failed`), review23c. Now it is not stored, as a response too large is not."""
    saved = SavedFiles.open(tmp_path)
    history = ResponseHistory(max_chars=2_000, saved=saved)
    response_id = f"resp_{'b' * 32}"
    history.put_unfinished(_unfinished(response_id), [], None)
    huge = [{"role": "user", "content": "x" * 5_000}]
    history.put(huge, {**_unfinished(response_id, "completed")}, [], salt=None, previous=None)
    saved.close()
    assert history.response(response_id, None) is None
    assert not (tmp_path / f"{response_id}.json").exists()


def test_a_restart_drops_what_memory_would_have_dropped(tmp_path):
    """Three responses and three conversations, the oldest of each used since: read back
    under a bound of two, the second ones go (the least recently used), not the first."""
    saved = SavedFiles.open(tmp_path)
    history, held = ResponseHistory(saved=saved), Conversations(saved=saved)
    ids = [f"resp_{n:032x}" for n in range(3)]
    for response_id in ids:
        _put(history, response_id)
    conversations = [held.create([HI], {}, None).id for _ in range(3)]
    assert history.response(ids[0], None) is not None  # a GET, a previous_response_id
    held.get(conversations[0], None)
    saved.close()

    again = SavedFiles.open(tmp_path)
    read = ResponseHistory(max_responses=2, saved=again)
    read_held = Conversations(max_conversations=2, saved=again)
    again.close()
    assert [read._find(i, None) is not None for i in ids] == [True, False, True]
    kept = [read_held._held.get(conversation) is not None for conversation in conversations]
    assert kept == [True, False, True]
    assert _files(tmp_path, "resp_") == {ids[0], ids[2]}


def test_files_are_read_in_the_order_written_and_used_even_at_once(tmp_path):
    """Written and used within a millisecond, with ids that sort the other way: a file
    system's own times can tie (ties were read in the order of ids)."""
    saved = SavedFiles.open(tmp_path)
    ids = [f"resp_{n:032x}" for n in range(20, 0, -1)]
    for response_id in ids:
        saved.write({"id": response_id})
    saved.touch(ids[0])
    saved.close()
    again = SavedFiles.open(tmp_path)
    read = [record["id"] for record in again.read("resp_", lambda record: None)]
    again.close()
    assert read == [*ids[1:], ids[0]]
