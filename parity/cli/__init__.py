"""Command-line entry points (tools/*.py are thin wrappers over these)."""
