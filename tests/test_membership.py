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


def test_a_worker_that_stopped_cleanly_is_not_called_dead(tmp_path):
    from trainguard.streams.app import membership_lines

    members = Memberships(tmp_path, "group")
    members.remember("member-stopped")
    members.mark_stopped()  # this process stops cleanly
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (members.folder / "dead").write_text(f"{dead.pid}\nmember-dead\n")
    assert members.stopped() == {"member-stopped"}
    assert sorted(m for _, m in members.orphaned()) == ["member-dead", "member-stopped"], "both are ended"
    lines = membership_lines(["member-dead", "member-stopped"], members.stopped())
    assert lines == ["ended 1 group membership(s) of a worker that died on this host",
                     "ended 1 group membership(s) of a worker that stopped on this host (its partitions come now, "
                     "not after its session)"]
    assert membership_lines(["member-stopped"], members.stopped())[0].startswith("ended 1 group membership(s) "
                                                                                  "of a worker that stopped")
