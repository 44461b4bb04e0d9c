"""The shared rule of the scripts' output folders (ddl_tools/outputs.py) at its edges: links, leftovers, full disks."""

import json
import os

import pytest

from ddl_tools.outputs import (FolderLock, UsageError, claim_folder, folder_contents, is_leftover, publish,
                               temporary_name, write_json)


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    """Taking the lock truncates the lock file to record the pid: through a link that would empty the file it
    points to."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / FolderLock.NAME)
    with pytest.raises(UsageError, match="is a link"):
        claim_folder(str(out), "--output_dir")
    assert victim.read_text() == "precious"


def test_leftover_writes_are_removed_by_the_next_claim_and_never_counted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".results.json.ddl-tmp").write_text("{")  # a write killed midway
    (out / "marker.json.tmp").write_text("{")  # an earlier version's name for one of the script's own files
    (out / "notes.tmp").write_text("mine")  # a user's file that merely ends in .tmp
    assert folder_contents(str(out), own_files=["marker.json"]) == ["notes.tmp"]
    lock, created = claim_folder(str(out), "--output_dir", own_files=["marker.json"])
    try:
        assert not created and sorted(os.listdir(out)) == [FolderLock.NAME, "notes.tmp"]
    finally:
        lock.release(remove=True)


def test_a_failed_write_leaves_neither_a_half_file_nor_its_temporary(tmp_path):
    path = tmp_path / "results.json"
    write_json(str(path), {"complete": True})

    class Unserialisable:
        def __repr__(self):
            raise RuntimeError("disk full")  # (json falls back to str(), which calls repr)

    with pytest.raises(RuntimeError):
        write_json(str(path), {"value": Unserialisable()})
    assert path.read_text().strip().endswith("}") and "complete" in path.read_text()
    assert os.listdir(tmp_path) == ["results.json"]


def test_two_writers_of_one_file_write_under_names_of_their_own(tmp_path):
    """(One shared temporary name let a second run truncate the first one's file while the first published it: a
    half-written file in place and a run's results lost.)"""
    names = {temporary_name(str(tmp_path / "results.json")) for _ in range(2)}
    assert len(names) == 2 and all(is_leftover(os.path.basename(name)) for name in names)


def test_a_file_named_as_long_as_the_file_system_allows_is_written(tmp_path):
    """(The random part made the temporary name of a 241-character name too long to create.)"""
    path = tmp_path / ("r" * 240 + ".json")
    write_json(str(path), {"a": 1}, replace=False)
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_file_written_without_replacing_leaves_an_existing_one_as_it_was(links, tmp_path, monkeypatch):
    """`write_json(..., replace=False)` writes where nothing is, and raises FileExistsError where a file (or a link)
    is, leaving it and no temporary file behind, also on a file system without hard links."""
    if not links:
        monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(PermissionError("no hard links here")))
    write_json(tmp_path / "new.json", {"a": 1}, replace=False)
    assert json.loads((tmp_path / "new.json").read_text()) == {"a": 1}
    (tmp_path / "target").write_text("kept")
    os.symlink(tmp_path / "target", tmp_path / "link.json")
    for name in ("new.json", "link.json"):
        with pytest.raises(FileExistsError):
            write_json(tmp_path / name, {"b": 2}, replace=False)
    assert json.loads((tmp_path / "new.json").read_text()) == {"a": 1} and (tmp_path / "target").read_text() == "kept"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "new.json", "target"]


def test_publish_through_a_link_and_dotdot_replaces_the_earlier_results(tmp_path):
    """`--output_dir link/../x` names deep/x (the link points to deep/a): normpath made it ./x, so the earlier
    run's audit files in deep/x were neither deleted nor listed, and the next run refused them as not its own."""
    (tmp_path / "deep" / "a").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "a")
    real = tmp_path / "deep" / "x"
    (real / "lm").mkdir(parents=True)
    for name in ("audit.json", "results.json"):
        (real / "lm" / name).write_text("earlier")
    (real / ".partial-1" / "lm").mkdir(parents=True)
    (real / ".partial-1" / "lm" / "results.json").write_text("new")
    root = os.path.join(str(tmp_path / "link"), "..", "x")
    records = []
    publish(os.path.join(root, ".partial-1"), root, ["lm/results.json"], ["lm/audit.json", "lm/results.json"],
            records.append)
    assert sorted(os.listdir(real / "lm")) == ["results.json"] and (real / "lm" / "results.json").read_text() == "new"
    assert records[-1] == ["lm/results.json"] and not (tmp_path / "x").exists()


def test_a_file_flag_through_a_link_and_dotdot_is_checked_in_its_real_folder(tmp_path, monkeypatch):
    """`--json link/../x/f.json` names real/x/f.json (the link's target's parent); abspath read it as ./x/f.json and
    refused a folder that exists (or probed another one)."""
    from ddl_tools.outputs import check_writable_file

    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "real" / "x").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real" / "deep")
    monkeypatch.chdir(tmp_path)
    check_writable_file(os.path.join("link", "..", "x", "f.json"), "--json")  # real/x exists: accepted
    with pytest.raises(UsageError, match="its folder .*does not exist"):
        check_writable_file(os.path.join("link", "..", "nope", "f.json"), "--json")
    assert sorted(os.listdir(tmp_path / "real" / "x")) == []  # the probe was removed
