"""Memory store behaviours checked against the upstream Hermes memory tool (docs/concepts.md#memory):
drift, exact matches, BOM and undecodable files, tool ergonomics, lock file mode."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from agent.memory import ENTRY_DELIMITER, MemoryStore


def mem_file(profile: Path, target: str = "memory") -> Path:
    return profile / "memories" / ("MEMORY.md" if target == "memory" else "USER.md")


async def tool(store: MemoryStore, **args: Any) -> dict[str, Any]:
    return json.loads(await store.handle_tool_call(args))


def backups(profile: Path, name: str = "MEMORY.md") -> list[Path]:
    return sorted((profile / "memories").glob(f"{name}.*.bak"))


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    return tmp_path / "profiles" / "alice"


@pytest.fixture
def store(profile: Path) -> MemoryStore:
    return MemoryStore(profile)


# -- drift ---------------------------------------------------------------------------


async def test_hand_edited_memory_survives_a_replace(store: MemoryStore, profile: Path) -> None:
    await store.add("memory", "Project uses Python 3.11")
    await store.add("memory", "Deploys on Fridays")
    path = mem_file(profile)
    with path.open("a", encoding="utf-8") as fh:  # typed by hand, outside the tool
        fh.write(ENTRY_DELIMITER + "Hand-typed: the cat is called Miso")
    edited = path.read_bytes()

    r = await tool(store, action="replace", target="memory", old_text="Python 3.11", content="Project uses Python 3.12")
    assert r["success"] is False and "changed outside the memory tool" in r["error"]
    assert any("Miso" in e for e in r["entries"]) and r["usage"]
    assert path.read_bytes() == edited  # left exactly as it is
    [kept] = backups(profile)
    assert kept.read_bytes() == edited

    # the on-disk text is the base now: the retry applies to what is really there
    r = await tool(store, action="replace", target="memory", old_text="Python 3.11", content="Project uses Python 3.12")
    assert r["success"] is True
    assert await store.entries("memory") == [
        "Project uses Python 3.12",
        "Deploys on Fridays",
        "Hand-typed: the cat is called Miso",
    ]


async def test_drift_is_detected_by_a_store_opened_after_a_restart(profile: Path) -> None:
    await MemoryStore(profile).add("user", "Likes tea")
    mem_file(profile, "user").write_text("Likes tea\n§\nLikes green tea best", encoding="utf-8")
    fresh = MemoryStore(profile)  # a new process: the baseline is on disk, not in memory
    r = await fresh.add("user", "Lives in Lyon")
    assert r["success"] is False and "changed outside" in r["error"]
    assert mem_file(profile, "user").read_text("utf-8") == "Likes tea\n§\nLikes green tea best"
    assert (await fresh.add("user", "Lives in Lyon"))["success"] is True
    assert await fresh.entries("user") == ["Likes tea", "Likes green tea best", "Lives in Lyon"]


async def test_an_add_keeps_a_line_typed_into_the_file_without_a_delimiter(store: MemoryStore, profile: Path) -> None:
    await store.add("memory", "Project uses Python 3.11")
    await store.add("memory", "Deploys on Fridays")
    path = mem_file(profile)
    with path.open("a", encoding="utf-8") as fh:  # a mild hand edit: one more line, no delimiter
        fh.write("\nand on Mondays before noon")
    r = await tool(store, action="add", target="memory", content="Uses pytest")
    assert r["success"] is True
    assert await store.entries("memory") == [
        "Project uses Python 3.11",
        "Deploys on Fridays\nand on Mondays before noon",
        "Uses pytest",
    ]
    # a rewriting action after that works against what is really there
    r = await tool(store, action="replace", target="memory", old_text="Python 3.11", content="Project uses Python 3.12")
    assert r["success"] is True


async def test_a_hand_written_file_the_store_never_wrote_is_its_base(store: MemoryStore, profile: Path) -> None:
    mem_file(profile).parent.mkdir(parents=True)
    mem_file(profile).write_text("Written before the gateway existed", encoding="utf-8")
    assert (await store.add("memory", "second"))["success"] is True
    assert await store.entries("memory") == ["Written before the gateway existed", "second"]
    assert backups(profile) == []


async def test_forget_after_a_hand_edit_erases_but_keeps_a_backup(store: MemoryStore, profile: Path) -> None:
    await store.add("memory", "one")
    mem_file(profile).write_text("one\n§\nby hand", encoding="utf-8")
    assert (await store.clear("memory"))["success"] is True
    assert await store.entries("memory") == []
    [kept] = backups(profile)
    assert kept.read_text("utf-8") == "one\n§\nby hand"


# -- matching ------------------------------------------------------------------------


async def test_exact_whole_entry_match_wins_over_substring(store: MemoryStore) -> None:
    await store.add("memory", "test")
    await store.add("memory", "tests pass")
    assert (await store.remove("memory", "test"))["success"] is True
    assert await store.entries("memory") == ["tests pass"]
    await store.add("memory", "test")
    assert (await store.replace("memory", "test", "unit test"))["success"] is True
    assert await store.entries("memory") == ["tests pass", "unit test"]
    r = await store.remove("memory", "t")  # still ambiguous: no entry is exactly "t"
    assert r["success"] is False and "matches 2 entries" in r["error"]


# -- encodings -----------------------------------------------------------------------


async def test_utf8_bom_is_stripped_from_the_first_entry(store: MemoryStore, profile: Path) -> None:
    mem_file(profile).parent.mkdir(parents=True)
    mem_file(profile).write_bytes("\ufeffLikes tea\n§\nLives in Lyon".encode("utf-8"))
    assert (await store.load_snapshot()).memory == ("Likes tea", "Lives in Lyon")
    assert (await store.remove("memory", "Likes tea"))["success"] is True
    assert mem_file(profile).read_bytes() == b"Lives in Lyon"


async def test_undecodable_bytes_are_never_written_back(store: MemoryStore, profile: Path) -> None:
    mem_file(profile).parent.mkdir(parents=True)
    raw = b"Likes tea\n\xc2\xa7\nCaf\xe9 owner"  # latin-1 byte in a UTF-8 file
    mem_file(profile).write_bytes(raw)
    r = await tool(store, action="add", target="memory", content="new fact")
    assert r["success"] is False and "not valid UTF-8" in r["error"]
    assert mem_file(profile).read_bytes() == raw
    assert "Likes tea" in (await store.load_snapshot()).memory  # still readable for the prompt


# -- tool ergonomics -----------------------------------------------------------------


async def test_null_target_defaults_to_memory(store: MemoryStore) -> None:
    r = await tool(store, action="add", target=None, content="defaulted")
    assert r["success"] is True
    assert await store.entries("memory") == ["defaulted"]


async def test_missing_old_text_returns_the_entries_and_usage(store: MemoryStore) -> None:
    await store.add("user", "Likes tea")
    await store.add("user", "Lives in Lyon")
    for action in ("replace", "remove"):
        r = await tool(store, action=action, target="user", content="x")
        assert r["success"] is False and "old_text" in r["error"]
        assert r["entries"] == ["Likes tea", "Lives in Lyon"]
        assert r["usage"] == f"{len('Likes tea' + ENTRY_DELIMITER + 'Lives in Lyon')}/1375"


async def test_a_preexisting_lock_file_gets_0600(store: MemoryStore, profile: Path) -> None:
    (profile / "memories").mkdir(parents=True)
    store.lock_path.touch()
    os.chmod(store.lock_path, 0o666)
    await store.add("memory", "x")
    assert stat.S_IMODE(store.lock_path.stat().st_mode) == 0o600


async def test_cosmetic_whitespace_edits_are_not_drift(store: MemoryStore, profile: Path) -> None:
    await store.add("memory", "First entry.")
    await store.add("memory", "Second entry.")
    for cosmetic in ("\ufeffFirst entry.\r\n§\r\nSecond entry.\r\n", "First entry.\n\n§\n  Second entry.\n\n"):
        mem_file(profile).write_text(cosmetic, encoding="utf-8", newline="")
        r = await tool(store, action="replace", target="memory", old_text="Second", content="Second entry!")
        assert r["success"] is True, r
        await store.replace("memory", "Second entry!", "Second entry.")
    assert backups(profile) == []
