"""bf16/fp16/fp32 ULP convention, comparison verdicts and tolerance rules (DESIGN §5). numpy + ml_dtypes only.

- `ulp`: dtype grids, RNE rounding (`to_dtype`), the monotone integer line (`ordered_int`), `ulp_distance`, `ulp_of`.
- `compare`: `compare(ref, test, rule) -> Verdict` with the hybrid floor + ULP (+ optional rtol/atol) rule.
- `tolerances`: `ToleranceRule`, `RulesTable` (first match wins per field), `load_rules`, `default_rules`,
  `parse_override(s)` for CLI strings.
"""

from parity.numerics.compare import ComparisonError, Verdict, allowed_over_count, compare, comparison_grid
from parity.numerics.tolerances import (RulesTable, ToleranceRule, default_rules, load_rules, parse_override,
                                        parse_overrides)
from parity.numerics.ulp import (DTYPE_NAMES, NO_ULP, dtype_name, ordered_int, to_dtype, ulp_distance, ulp_of,
                                 value_class)

__all__ = [
    "ComparisonError", "Verdict", "allowed_over_count", "compare", "comparison_grid",
    "RulesTable", "ToleranceRule", "default_rules", "load_rules", "parse_override", "parse_overrides",
    "DTYPE_NAMES", "NO_ULP", "dtype_name", "ordered_int", "to_dtype", "ulp_distance", "ulp_of", "value_class",
]
