"""Moved to parity.calibration (issue 27): kept as a re-export for code that imports `parity.exactness_corpus`."""

from parity.calibration.corpus import ROW_COUNT_RULE, preset_of, replay_rows  # noqa: F401
from parity.calibration.exactness_rates import *  # noqa: F401,F403
from parity.calibration.exactness_rates import (MAX_RATE, MIN_POINTS, SCALE_FLOOR, SCALE_MARGIN,  # noqa: F401
                                                TEACHER_FORCED_NORMS, derive_rates, derive_scale_noise,
                                                load_corpus, rates_toml, save_corpus)
