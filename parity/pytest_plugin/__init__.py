"""The pytest face of the suite (DESIGN §8): the plugin, xdist grouping, the CI summary."""
