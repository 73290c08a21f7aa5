"""tests/sweeps.py's patterns stay true to the suite: each names cases that exist (a renamed test or parameter would
otherwise leave a pattern that skips nothing, or a case that silently returns to the default run) and keeps at least
one case of its test function in the default slice (or names the test file covering it)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from conftest import COLLECTED
from sweeps import BEYOND_SLICE, beyond_slice


def test_every_pattern_names_collected_cases_and_leaves_a_kept_case(request):
    ids = request.config.stash[COLLECTED]  # all collected ids, -k / -m deselection or not
    files = {i.split("::")[0] for i in ids}
    problems = []
    for pattern, why in BEYOND_SLICE.items():
        if pattern.split("::")[0] not in files:  # a partial run (pytest tests/test_x.py) collects only some files
            continue
        matched = [i for i in ids if fnmatchcase(i, pattern.replace("[", "[[]"))]
        if not matched:
            problems.append(f"{pattern}: matches no collected test")
            continue
        func = pattern.split("[")[0]
        kept = [i for i in ids if fnmatchcase(i.split("[")[0], func) and beyond_slice(i) is None]
        if not kept and ".py" not in why:  # a whole function may go only where its reason names the test covering it
            problems.append(f"{pattern}: no case of {func} is left in the default slice, and the reason names no "
                            "test file that covers it")
        if not why.strip():
            problems.append(f"{pattern}: no reason given")
    assert not problems, "tests/sweeps.py: " + "; ".join(problems)
