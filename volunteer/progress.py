"""How far a slice download got, read from the downloaders' part files (shell: reads two small files).

The market's dashboard shows it ("downloading 40 %") from the heartbeat's ``download`` field. The
downloaders keep their progress on disk so that an interrupted download resumes; this reads it
back, so the downloaders need no callback:
- ``swarm.model.sources`` (per expert, from peers, mirrors or the coordinator): ``<dest>.part`` has the
  slice's full size from the start and ``<dest>.part.done`` lists the verified expert groups
  ``LO-HI`` one a line, after a header line: done = the share of the slice's experts listed;
- ``swarm.model.fetch`` (one HTTP file from the coordinator): ``<dest>.part`` grows as bytes arrive.

Rules: never more than ``size``; 0 when nothing is on disk yet; malformed lines are skipped (a
progress figure is for people, never a decision).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["downloaded_bytes"]


def downloaded_bytes(dest: Path, size: int, lo: int, hi: int) -> int:
    """Bytes of the slice file ``dest`` (``size`` bytes, experts ``lo..hi-1``) downloaded so far."""
    done = dest.with_name(dest.name + ".part.done")
    try:
        lines = done.read_text(errors="replace").splitlines()[1:]
    except OSError:
        lines = None
    if lines is not None:
        got: set[int] = set()
        for line in lines:
            a, sep, b = line.strip().partition("-")
            if sep and a.isdigit() and b.isdigit():
                got.update(range(max(lo, int(a)), min(hi, int(b))))
        return min(size, size * len(got) // max(1, hi - lo))
    try:
        return min(size, dest.with_name(dest.name + ".part").stat().st_size)
    except OSError:
        return 0
