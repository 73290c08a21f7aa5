"""The memory accounting of `tools/backward_cost.py` (`parity.backward_cost`): what counts as activations."""

from __future__ import annotations

import torch

from parity.backward_cost import distinct_storage_bytes, rss_bound_ratio, saved_activation_bytes


def test_distinct_storage_bytes_counts_a_storage_once_and_skips_excluded():
    records = [(1, 8), (2, 16), (1, 8), (3, 4)]
    assert distinct_storage_bytes(records) == 28
    assert distinct_storage_bytes(records, exclude=[3]) == 24


def test_linear_relu_saves_its_input_and_output_not_its_weight():
    lin = torch.nn.Linear(4, 8)
    x = torch.randn(3, 4, requires_grad=True)
    out, act = saved_activation_bytes(lambda: torch.relu(lin(x)), lin.parameters())
    # addmm saves x and weight.t() (a view of the weight's storage: excluded); relu saves its output
    assert act == x.nbytes + out.nbytes == 3 * 4 * 4 + 3 * 8 * 4
    out.sum().backward()  # the hook returned the tensors themselves: the backward still runs
    assert x.grad is not None and lin.weight.grad is not None


def test_a_tensor_saved_twice_is_counted_once():
    x = torch.randn(5, 7, requires_grad=True)
    _, act = saved_activation_bytes(lambda: x * x, [])
    assert act == x.nbytes


def test_what_a_dropped_branch_saved_is_not_counted():
    x = torch.randn(5, 7, requires_grad=True)

    def forward():
        y = torch.sigmoid(x)  # saves its output; dropped below with its graph
        del y
        return torch.relu(x)  # saves its output

    out, act = saved_activation_bytes(forward, [])
    assert act == out.nbytes


def test_rss_bound_ratio_counts_weights_twice():
    assert rss_bound_ratio(6.0, 1.0, 2.0) == 1.5
