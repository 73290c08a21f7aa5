"""Moved to parity.calibration (issue 27): kept as a re-export for code that imports `parity.calibrate`."""

from parity.calibration.corpus import (CorpusSpec, Measurement, measure_dump_pair, measure_replay,  # noqa: F401
                                       remeasure)
from parity.calibration.noise import FLOORS, FLOORS_FP32, KS, RTOL_FP32, floors_of, point_noise  # noqa: F401
from parity.calibration.rules import *  # noqa: F401,F403
from parity.calibration.rules import (BF16_FLOOR, FREE_FRACTION, HARD_OFF_ABOVE, LAYER_FRACTION,  # noqa: F401
                                      MINIMUMS, SAFETY, site_class)
