"""Calibration: one corpus walk, every derived quantity (issue 27). Nothing is imported here (no import circles).

- `corpus`: the corpus walk (`Run`s: dump, replay, measure) over the noise and exactness corpora.
- `noise`: the per-point noise statistic (`point_noise`).
- `rules`: tolerance rules from the noise points (`propose_rules`, `rules_toml`) -> default_tolerances.toml.
- `bounds`: per-element safety bounds (`derive_bounds`) -> safety_bounds.toml.
- `exactness_rates`: isolated-mode exactness rates and norm-scale noise -> exactness_rates.toml.
- `resolution`: detection resolution of each replay mode (the resolution table).
- `pipeline`: stored measurements -> every generated file (`derive`); CLI: `python tools/calibrate.py`.
"""
