"""Calibration: one corpus walk, every derived quantity, one generated file (issue 27). Nothing is imported here (no
import circles).

- `corpus`: the corpus walk (`Run`s: dump, replay, measure) over the noise, exactness and real-kernel corpora.
- `noise`: the per-point noise statistic (`point_noise`).
- `rules`: tolerance rules from the noise points (`propose_rules`) -> section `tolerances`.
- `bounds`: per-element safety bounds (`derive_bounds`) -> section `safety_bounds`.
- `exactness_rates`: isolated-mode exactness rates and norm-scale noise -> section `exactness_rates`.
- `resolution`: detection resolution of each replay mode (the resolution table).
- `pipeline`: stored measurements -> parity/numerics/calibration.toml (one header, one section per derived quantity;
  `derive`); CLI: `python tools/calibrate.py corpus|rules|resolution`.
"""
