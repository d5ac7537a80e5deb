"""The connector's running totals (its ``stats_file``): written in the order they were taken.

The step and the saver thread both flush. A CI run read a worker's stats file 17 loaded blocks
behind its totals: one thread had taken its snapshot, the other took a newer one and wrote it
first, and the older one landed last; nothing wrote the file again until the next change."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from kvtier.vllm import _Counters

pytestmark = pytest.mark.timeout(60)


class _LateLock:
    """A lock whose first taker from another thread is held up just before it takes it: the
    moment at which a flush that snapshots before taking the lock is overtaken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = threading.get_ident()
        self.held_up = threading.Event()

    def __enter__(self) -> None:
        if threading.get_ident() != self._owner and not self.held_up.is_set():
            self.held_up.set()
            time.sleep(0.3)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_flush_overtaken_by_a_newer_one_does_not_leave_the_file_behind(
    tmp_path: Path,
) -> None:
    c = _Counters(str(tmp_path / "s"), "worker")
    late = _LateLock()
    c._write_lock = late  # the interleaving under test
    c.add(loaded_blocks=1)
    saver = threading.Thread(target=c.flush)
    saver.start()
    assert late.held_up.wait(10)
    # The step counts a load and flushes while the saver's flush is held up.
    c.add(loaded_blocks=17)
    c.flush()
    saver.join(10)
    assert not saver.is_alive()
    on_disk = json.loads((tmp_path / "s.worker.json").read_text())
    assert on_disk["loaded_blocks"] == c.total["loaded_blocks"] == 18, on_disk


def test_totals_are_written_only_when_they_changed(tmp_path: Path) -> None:
    c = _Counters(str(tmp_path / "s"), "scheduler")
    path = tmp_path / "s.scheduler.json"
    c.flush()
    assert not path.exists(), "nothing counted yet: nothing written"
    c.add(lookups=2)
    c.flush()
    assert json.loads(path.read_text())["lookups"] == 2
    path.unlink()
    c.flush()
    assert not path.exists(), "unchanged totals are not written again"
    assert c.take()["lookups"] == 2 and c.take()["lookups"] == 0, "the interval resets"
