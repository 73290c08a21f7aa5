"""ling3-parity: numerical cross-framework parity suite for Ling3 (HF bailing_hybrid) vs JAX ports.

Layout and contracts: see the repository README and ../shared/DESIGN.md.
"""

from parity.errors import ParityError

__version__ = "0.1.0"

__all__ = ["ParityError", "__version__"]
