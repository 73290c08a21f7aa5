"""Moved to parity.calibration.bounds (issue 27): kept as a re-export for code that imports parity.numerics.bounds."""

from parity.calibration.bounds import *  # noqa: F401,F403
from parity.calibration.bounds import (BOUNDS_FILE, MIN_ULPS, SAFETY, SOURCES, UNIT, Bound,  # noqa: F401
                                       check_points, derive_bounds, nice_up, render_toml, safety_from_growth,
                                       tail_growth, worst_rms)
