"""Which recorded group memberships a starting worker ends: only those whose process is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from trainguard.streams.transport import Memberships


def test_only_members_whose_process_is_gone_are_orphaned(tmp_path):
    members = Memberships(tmp_path, "group")
    members.remember("member-of-this-process")  # a previous incarnation with our pid (a container restart)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (members.folder / "dead").write_text(f"{dead.pid}\nmember-dead\n")
    (members.folder / "alive").write_text(f"{os.getppid()}\nmember-alive\n")
    (members.folder / "garbage").write_text("not a pid\n")
    orphaned = sorted(member for _, member in members.orphaned())
    assert orphaned == ["member-dead", "member-of-this-process"]
    assert not (members.folder / "garbage").exists()


def test_an_unwritable_folder_costs_a_slower_restart_not_a_crash(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    Memberships(blocker, "group").remember("m")  # "members" cannot be made under a file
    assert "cannot record the group membership" in caplog.text
    assert Memberships(blocker, "group").orphaned() == []
