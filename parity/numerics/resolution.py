"""Moved to parity.calibration.resolution (issue 27): kept as a re-export for code that imports
parity.numerics.resolution."""

from parity.calibration.resolution import *  # noqa: F401,F403
from parity.calibration.resolution import (KINDS, RELATIVE_SCAN, ULP_SCAN, Resolution,  # noqa: F401
                                           detection_rate, plant, resolution)
