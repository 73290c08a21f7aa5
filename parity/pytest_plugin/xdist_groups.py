"""With `pytest -n`, every point of one (dump, layer) runs on one xdist worker, which replays that layer once.

Why not xdist's own `--dist loadgroup`: its workers carry the group to the controller by appending `@group` to each
item's `_nodeid`; pytest 9.2 derives node ids from a structured id instead, so the write is lost and loadgroup
silently schedules like `load` (pytest-xdist issue #1386, open with pytest 9.2.0 + pytest-xdist 3.8.0). The
controller's scheduler only ever sees node ids, and a parity point's id already names its group
(`test_point[<dump>/<layer_i|model|MTPj>/<site>]`), so this scheduler reads the group from the id itself and
needs nothing from the workers.
"""

from __future__ import annotations

import re

from xdist.scheduler import LoadGroupScheduling

# the id the plugin gives a parity test (parity/pytest_plugin/plugin.py parity_params): `<run>/<layer>/<site>`, where the run is a
# dump label (a file name) or `<label>/<mode>` when one pytest run replays several modes (`<run>/MTP<j>/<site>` for
# an MTP layer's sites: one group per MTP layer); a site has no "/"
_POINT_ID = re.compile(r"::test_point\[(?P<dump>.+)/(?P<layer>layer_\d+|model|MTP\d+)/[^/]+\]$")


def point_group(nodeid: str) -> str | None:
    """The (dump, layer) group of a parity point's node id, None for any other test. A layer's backward points
    (`<run>/backward/<layer>/<site>`) are in its group: one replay of the unit serves both phases, so a worker that got
    only one of them would replay the whole unit again."""
    m = _POINT_ID.search(nodeid)
    if not m:
        return None
    run = m["dump"].removesuffix("/backward")
    return f"parity:{run}:{m['layer']}"


class ParityGroupScheduling(LoadGroupScheduling):
    """xdist's loadgroup (an `@group` suffix still groups, where pytest keeps it), plus parity points grouped per
    (dump, layer) from their ids; every other test is its own unit, spread over the workers as loadgroup does — or,
    with the ini option `parity_xdist_group_files = true`, grouped per test file (as `--dist loadfile`): a file's
    tests then share one worker's module fixtures and compiled programs instead of both workers building them
    (this repository's own suite sets it: issue 35, README command two's time)."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._group_files = bool(config.getini("parity_xdist_group_files"))

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        if scope != nodeid:
            return scope
        group = point_group(nodeid)
        if group is not None:
            return group
        return nodeid.split("::", 1)[0] if self._group_files else nodeid
