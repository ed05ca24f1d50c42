import os
import stat

import pytest

from clover.files import atomic_write, atomic_write_text


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_atomic_write_replaces_whole_with_its_mode(tmp_path):
    target = tmp_path / "sub" / "table.json"  # a missing parent is made
    atomic_write_text(target, "one")
    assert target.read_text() == "one"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    atomic_write_text(target, "two", mode=0o600, durable=False)
    assert target.read_text() == "two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _leftovers(target.parent) == []


def test_a_private_file_is_never_readable_by_others_while_written(tmp_path):
    target = tmp_path / "store.jsonl"
    seen = []

    def write(tmp):
        seen.append(stat.S_IMODE(os.stat(tmp).st_mode))
        tmp.write_text("prompt ids")

    atomic_write(target, write, mode=0o600)
    assert seen == [0o600] and target.read_text() == "prompt ids"


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    target = tmp_path / "drafter.safetensors"
    atomic_write_text(target, "old")

    def half(tmp):
        tmp.write_text("half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, half)
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):  # an interrupt cleans up the same way

        def interrupted(tmp):
            raise KeyboardInterrupt

        atomic_write(target, interrupted)
    assert target.read_text() == "old" and _leftovers(tmp_path) == []
