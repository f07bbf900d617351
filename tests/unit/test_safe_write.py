"""Writes beside the target, renamed into place; only this module's own leftovers removed."""

import pytest

from vllm_specstream.safe_write import files_into, new_dir


def test_new_dir_replaces_the_target_and_removes_only_its_own_leftovers(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("earlier run")
    own = tmp_path / ".out.0123456789ab.partial"  # an interrupted write's
    own.mkdir()
    users = [tmp_path / "out.partial", tmp_path / ".out.notes"]
    for path in users:
        path.write_text("a user's")
    with new_dir(target) as tmp:
        (tmp / "new.txt").write_text("this run")
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.notes", "out", "out.partial"]


def test_an_error_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("before")
    with pytest.raises(RuntimeError), new_dir(target) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError
    with pytest.raises(RuntimeError), files_into(target) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (target / "a.txt").read_text() == "before"


def test_files_into_keeps_what_else_the_target_holds(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    (target / "log.jsonl").write_text("records")
    (target / "a.txt").write_text("v1")
    with files_into(target) as tmp:
        (tmp / "a.txt").write_text("v2")
    assert (target / "log.jsonl").read_text() == "records"
    assert (target / "a.txt").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
