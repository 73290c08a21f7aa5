"""The parity tests: one per compared site of every layer of every selected dump, covering each step the dump was
made with (ids hold dump/layer_{i}/site; report.json holds one record per point); and one per (dump, mode, layer) of
every Kimi Linear dump (`parity.pytest_plugin.kimi`: ids hold dump/mode/layer_{i}).

Parametrised by the plugin (`parity/pytest_plugin/plugin.py`); run `pytest parity -k layer_3` for layer 3 only.
"""

from parity.pytest_plugin.plugin import run_kimi_unit, run_point


def test_point(request, parity_dump, parity_points, parity_layer):
    run_point(request, parity_dump, parity_points, parity_layer)


def test_kimi_layer(request, parity_kimi_unit):
    run_kimi_unit(request, parity_kimi_unit)
