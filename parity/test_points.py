"""The parity tests: one per compared site of every layer of every selected dump, covering each step the dump was
made with (ids hold dump/layer_{i}/site; report.json holds one record per point).

Parametrised by the plugin (`parity/pytest_plugin/plugin.py`); run `pytest parity -k layer_3` for layer 3 only.
"""

from parity.pytest_plugin.plugin import run_point


def test_point(request, parity_dump, parity_points, parity_layer):
    run_point(request, parity_dump, parity_points, parity_layer)
