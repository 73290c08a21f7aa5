"""The parity tests: one per compared point of every selected dump (ids hold dump/phase/layer_{i}/site).

Parametrised by the plugin (`parity/plugin.py`); run `pytest parity -k layer_3` for layer 3 only.
"""

from parity.plugin import run_point


def test_point(request, parity_dump, parity_point, parity_layer):
    run_point(request, parity_dump, parity_point, parity_layer)
