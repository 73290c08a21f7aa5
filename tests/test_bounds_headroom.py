"""Issue 35: every numeric bound of tests/ is declared in tests/bounds.py with its measurement and at least ×3
headroom over it (or is float64/fp64-relative by construction), and no bare float tolerance hides elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bounds
from bounds import AllClose, Bound, headroom_problems, largest_passing, literal_tolerances

TESTS = Path(__file__).resolve().parent


def test_every_bound_has_a_recorded_measurement_and_three_times_headroom():
    problems = headroom_problems()
    print("\n".join(f"{b.name:36s} {float(b):<9.3g} measured {b.measured!s:<10} x{b.headroom:.1f} {b.kind}"
                    for b in bounds.REGISTRY.values()))
    if bounds.PENDING:
        print("measurement pending (tests/bounds.py PENDING):", ", ".join(sorted(bounds.PENDING)))
    assert not problems, "\n".join(problems)


def test_headroom_check_fails_below_three_times_the_measurement():
    def b(value, measured, kind="measured"):
        return Bound("T", value, measured=measured, measured_on=(bounds.XEON,), why="t", kind=kind, register=False)

    assert headroom_problems([b(3e-5, 1e-5)]) == []
    (msg,) = headroom_problems([b(2.9e-5, 1e-5)])
    assert "T = 2.9e-05: headroom ×2.90 over measured 1e-05, expected >= ×3" in msg
    assert headroom_problems([b(1e-5, None)]) and headroom_problems([b(3.0, 1.5, "fp64-relative")])
    assert headroom_problems([b(1e-10, None, "exact")]) == []  # float64 maths: no CPU-dependent measurement needed
    assert headroom_problems([b(1.0, 0.95, "exact")]) == []  # the arithmetic's worst case: within it is enough
    assert headroom_problems([b(1.0, 1.2, "exact")])
    c = AllClose("C", rtol=1e-6, atol=1e-7, measured=0.5, measured_on=(bounds.XEON,), why="t")  # not-a-bound: the checker's own unit test
    bounds.REGISTRY.pop("C")
    assert c.headroom == 2.0 and headroom_problems([c])


def test_allclose_usage_and_message():
    c = AllClose("C", rtol=1e-3, atol=1e-6, measured=None, measured_on=(), why="t")  # not-a-bound: the checker's own unit test
    bounds.REGISTRY.pop("C")
    want = np.array([1.0, 2.0, 0.0])
    assert c.usage(want + [5e-4, 0, 0], want) == pytest.approx(5e-4 / (1e-6 + 1e-3))
    c.check(want + [5e-4, 0, 5e-7], want)
    with pytest.raises(AssertionError, match=r"outside C .* worst at \(1,\)"):
        c.check(want + [0, 3e-3, 0], want)
    with pytest.raises(AssertionError, match="shapes differ"):
        c.check(want[:2], want)


def test_bounds_log_keeps_the_largest_passing_value(tmp_path, monkeypatch):
    log = tmp_path / "b.jsonl"
    monkeypatch.setenv(bounds.LOG_VAR, str(log))
    b = Bound("L", 1e-5, measured=None, measured_on=(), why="t", register=False)
    assert 2e-6 <= b and not 3e-5 <= b and 4e-6 < b and b > 1e-6  # each comparison, either side, is logged
    top, ok, bad = largest_passing(log.read_text().splitlines())["L"]
    assert (top, ok, bad) == (4e-6, 3, 1)


def test_no_bare_float_tolerance_outside_the_registry():
    found = [f"tests/{p.name}:{n}: {line}" for p in sorted(TESTS.glob("*.py")) if p.name != "bounds.py"
             for n, line in literal_tolerances(p.read_text())]
    assert not found, ("float literals used as tolerances: declare them in tests/bounds.py with their measurement, "
                       "or mark a line that is not a tolerance `# not-a-bound: <reason>`:\n" + "\n".join(found))


def test_the_scan_finds_planted_tolerances():
    src = '''
TOL = 1e-4
LIMIT = 7
def f(err, a, b):
    assert err <= 2e-5
    assert 1e-3 > err
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=-1e-7)
    assert_rel_close(a, b, 1e-5, "x")
    assert err < 0.5  # not-a-bound: a property of the data
    assert err < 0.25  # not-a-bound:
    x = 1e-6 * a
    assert err == pytest.approx(0.5)
    s = "assert err <= 1e-9"  # strings and comments are not code: assert err <= 1e-9
'''
    got = [line for _, line in literal_tolerances(src)]
    assert got == ["TOL = 1e-4", "assert err <= 2e-5", "assert 1e-3 > err",
                   "np.testing.assert_allclose(a, b, rtol=1e-6, atol=-1e-7)",
                   "np.testing.assert_allclose(a, b, rtol=1e-6, atol=-1e-7)", 'assert_rel_close(a, b, 1e-5, "x")',
                   "assert err < 0.25  # not-a-bound:"], got


def test_pending_names_only_declared_unmeasured_bounds():
    """PENDING (bounds whose measurement is outstanding) cannot hide a measured or an unknown bound."""
    assert bounds.PENDING <= set(bounds.REGISTRY), sorted(bounds.PENDING - set(bounds.REGISTRY))
    stale = sorted(n for n in bounds.PENDING if bounds.REGISTRY[n].measured is not None)
    assert not stale, f"measured now, remove from PENDING: {stale}"
