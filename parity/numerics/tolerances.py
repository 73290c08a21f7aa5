"""Tolerance rules as data (DESIGN §5): a table (site glob × replay-mode glob × dtype [× compute dtype]) → rule.

A `ToleranceRule` is the hybrid criterion of `parity.numerics.compare`:
  floor_ulps        absolute floor: |a - b| ≤ floor_ulps · ulp(RMS of the reference row) always passes
  max_ulps          elements above it (after the floor) may make up at most `allowed_fraction` of the tensor
  allowed_fraction  in [0, 1]
  hard_ulps         no element (after the floor) may be above it
  rtol, atol        optional allclose tier: every element outside the floor must have |a - b| ≤ atol + rtol·|ref|
  compare_dtype     compare on this dtype's grid instead of the reference's own (e.g. fp32 router logits of a bf16
                    run judged in bf16 ULPs); None = the reference's dtype
  bound_rms         per-element safety bound: every finite element must have |a - b| ≤ bound_rms · RMS(reference row)
                    (or be within the absolute floor), whatever `allowed_fraction` lets pass — finite garbage fails.
                    Derived from the calibration corpus, not tuned: `parity.calibration.bounds`.
  inexact_row_rate  exactness test (isolated mode): the rate p0 at which a correct implementation's rows hold any
                    non-bit-identical element; the point fails when r inexact rows of R are less likely than
                    parity.numerics.exactness.ALPHA under Binomial(R, p0). Calibrated: `parity.calibration.exactness_rates`.
  norm_scale_noise  rounding check of RMSNorm sites (isolated mode, bf16): every target element must be a bf16 value
                    the reference formula gives with its fp32 row scale within norm_scale_noise·2^-24·√n relative of
                    exact (parity.numerics.rounding). Calibrated with the exactness rates.
  precision_ratio   three-way verdict of bf16 points (parity.replay.shadows, kind `precision`): a point failing the
                    criteria above is `variant` more-precise-than-reference where its error against the high-precision
                    (fp32) shadow is at most precision_ratio × the dump's own error against it (L2 norms).
                    Calibrated: `parity.calibration.precision`.
  precision_dump_peak  the same verdict's guard on the dump: it applies only where the dump's own peak error against
                    the shadow, max |dump − shadow| / RMS(shadow row), is at most this (rounding, not an edited dump
                    or another formula). Calibrated with precision_ratio. In layer mode, at a site with an isolated
                    form, the guard asks about the site itself: the peak against the fp32 site fed the dump's own
                    inputs, bounded by the site's *isolated* ceiling (the layer shadow's peak also holds what the dump
                    inherited; parity.replay.shadows `precision_entry`); elsewhere the layer ceiling bounds the layer
                    peak.
  max_rel_l2        per-tensor criterion (issue 33): the whole tensor's rel-L2, ||test − ref||₂ / ||ref||₂ on the
                    comparison grid, must be at most this, whatever the element criteria let pass. Set by the bf16
                    gradient rules (a gradient of two correct bf16 implementations differs by up to ~1× its RMS in a
                    few elements, so an element rule cannot tell a zeroed small gradient from noise; its rel-L2 can).
                    Calibrated: `parity.calibration.gradients`.
`max_ulps`, `hard_ulps`, `rtol`, `atol`, `compare_dtype`, `bound_rms`, `inexact_row_rate`, `norm_scale_noise`,
`precision_ratio`, `precision_dump_peak`, `max_rel_l2` may be "off" (None). A rule with no criterion left
(max_ulps, hard_ulps, rtol, atol and max_rel_l2 all off) is rejected: it could never fail.

Table lookup, `RulesTable.rule_for(site, mode, dtype, compute_dtype=None)` — **first match wins, per field**:
for each field, the first entry in table order whose four patterns all match gives its value; entries may set only
some fields (the rest come from later, more general entries). So write files most-specific-first and end with
catch-alls. `a.merged(b)` puts b's entries before a's: overrides win. Patterns are `fnmatch` globs (case-sensitive)
on the canonical site name (e.g. `attention.*`, `mlp.gate.logits`, `attention.dense:in`), the replay mode
(`layer`, `free`, `forced`, ...), the tensor's dtype and the run's compute dtype (`compute`, default "*"; when the
caller gives no compute dtype only "*" matches it).

File format (TOML, read with tomllib):
    [[rule]]
    site = "mlp.*"         # optional, default "*"
    mode = "layer"         # optional, default "*"
    dtype = "bfloat16"     # optional, default "*"
    compute = "float32"    # optional, default "*"
    max_ulps = 8           # any subset of the rule fields
    note = "why"           # optional free text
The packaged defaults are one generated file, `calibration.toml` (`python tools/calibrate.py rules`,
parity.calibration.pipeline): one header (command, date, machine of each corpus), then one array of tables per
section, `[[gradient_tolerances]]` (the backward phase's rules, sites `backward/*`), `[[tolerances]]` (the calibrated
rules), `[[safety_bounds]]` (only `bound_rms`), `[[exactness_rates]]` (only `inexact_row_rate`, `norm_scale_noise`) —
each entry in the [[rule]] format above — and `sections = [...]`, the lookup order: `default_rules()` is the sections'
entries concatenated in that order (first match wins, per field).
A section may be conditional, `[when.<section>]` fork = "value": its entries apply only to a dump whose recorded
semantics (parity.model.semantics) have those values — `RulesTable.for_semantics(dump semantics)`, which a replay
session applies; without it (no dump at hand) conditional entries are skipped. The calibrated rules of real-kernel
bf16 dumps are such a section (`kda_chunk_precision = "bfloat16"`).
A new class of derived rules is one more section listed in `sections` (as the gradient rules are).

CLI override strings: `SITE:MODE:DTYPE:field=value[,field=value...]`, e.g. `mlp.*:layer:bfloat16:max_ulps=8,hard_ulps=64`
(`compute=float32` may appear among the fields; SITE may itself contain ':' as in `attention.dense:in`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from parity.errors import ToleranceError
from parity.numerics.ulp import DTYPE_NAMES

CALIBRATION_FILE = "calibration.toml"  # generated by tools/calibrate.py (parity.calibration.pipeline)
CALIBRATION_SCHEMA = "ling3-parity-calibration"
SCHEMA = "ling3-parity-tolerances"
RULE_FIELDS = ("floor_ulps", "max_ulps", "allowed_fraction", "hard_ulps", "rtol", "atol", "compare_dtype", "bound_rms",
               "inexact_row_rate", "norm_scale_noise", "precision_ratio", "precision_dump_peak", "max_rel_l2")
REQUIRED_FIELDS = ("floor_ulps", "max_ulps", "allowed_fraction", "hard_ulps")
KEY_FIELDS = ("site", "mode", "dtype", "compute")
_OFF = ("off", "none")


# ------------------------------------------------------------------------------------------------ field checks
def _check_field(field: str, value: Any) -> Any:
    """Validated (and normalised) value of one rule field; raises ValueError with what was expected."""
    nullable = field not in ("floor_ulps", "allowed_fraction")
    if nullable and (value is None or (isinstance(value, str) and value.lower() in _OFF)):
        return None
    if field == "compare_dtype":
        if value not in DTYPE_NAMES:
            raise ValueError(f"expected one of {', '.join(DTYPE_NAMES)} or 'off'")
        return value
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    if field in ("max_ulps", "hard_ulps"):
        if not is_num or not math.isfinite(value) or value < 0 or int(value) != value:
            raise ValueError("expected an integer ≥ 0 or 'off'")
        return int(value)
    if field == "inexact_row_rate":
        if not is_num or not 0 < value <= 1:
            raise ValueError("expected a number in (0, 1] or 'off'")
        return float(value)
    if field == "allowed_fraction":
        if not is_num or not 0 <= value <= 1:
            raise ValueError("expected a number in [0, 1]")
        return float(value)
    if field in ("floor_ulps", "rtol", "atol", "bound_rms", "norm_scale_noise", "precision_ratio",
                 "precision_dump_peak", "max_rel_l2"):
        if not is_num or not math.isfinite(value) or value < 0:
            raise ValueError("expected a finite number ≥ 0" + ("" if field == "floor_ulps" else " or 'off'"))
        return float(value)
    raise ValueError(f"unknown field; expected one of {', '.join(KEY_FIELDS + RULE_FIELDS)}")


def _check_pattern(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty glob string")
    if key in ("dtype", "compute") and not any(c in value for c in "*?[") and value not in DTYPE_NAMES:
        raise ValueError(f"expected one of {', '.join(DTYPE_NAMES)} or a glob such as '*'")
    return value


@dataclass(frozen=True)
class ToleranceRule:
    """One resolved rule (see the module docstring for the meaning of each field)."""

    floor_ulps: float
    max_ulps: int | None
    allowed_fraction: float
    hard_ulps: int | None
    rtol: float | None = None
    atol: float | None = None
    compare_dtype: str | None = None
    bound_rms: float | None = None
    inexact_row_rate: float | None = None
    norm_scale_noise: float | None = None
    precision_ratio: float | None = None
    precision_dump_peak: float | None = None
    max_rel_l2: float | None = None

    def __post_init__(self) -> None:
        for f in RULE_FIELDS:
            try:
                object.__setattr__(self, f, _check_field(f, getattr(self, f)))
            except ValueError as e:
                raise ToleranceError(f"ToleranceRule: {f} = {getattr(self, f)!r}: {e}") from None
        problem = _cross_check(self)
        if problem:
            raise ToleranceError(f"ToleranceRule: {problem}")

    @property
    def has_ulp_criterion(self) -> bool:
        return self.max_ulps is not None or self.hard_ulps is not None

    @property
    def has_allclose(self) -> bool:
        return self.rtol is not None or self.atol is not None

    def to_dict(self) -> dict:
        # every field is a scalar: a flat copy is what asdict gives, without its deep-copy walk (once per point)
        return {f: getattr(self, f) for f in RULE_FIELDS}

    def describe(self) -> str:
        """Short text: 'floor 1 ULP of row RMS, max 2 ULP on ≤ 0.1%, hard 64 ULP'."""
        parts = [f"floor {self.floor_ulps:g} ULP of row RMS"]
        if self.max_ulps is not None:
            parts.append(f"max {self.max_ulps} ULP on ≤ {_pct(self.allowed_fraction)}")
        if self.hard_ulps is not None:
            parts.append(f"hard {self.hard_ulps} ULP")
        if self.has_allclose:
            parts.append(f"rtol {self.rtol or 0:g}, atol {self.atol or 0:g}")
        if self.compare_dtype:
            parts.append(f"compared in {self.compare_dtype}")
        if self.max_rel_l2 is not None:
            parts.append(f"tensor rel-L2 ≤ {self.max_rel_l2:g}")
        if self.bound_rms is not None:
            parts.append(f"no element beyond {self.bound_rms:g}×row RMS")
        if self.inexact_row_rate is not None:
            parts.append(f"inexact rows as from a rate ≤ {self.inexact_row_rate:.2g}")
        if self.norm_scale_noise is not None:
            parts.append(f"RMSNorm rounding within {self.norm_scale_noise:g}·u·√n of the exact row scale")
        if self.precision_ratio is not None:
            parts.append(f"more precise than the reference where its error vs the fp32 shadow ≤ "
                         f"{self.precision_ratio:g}× the dump's"
                         + ("" if self.precision_dump_peak is None else
                            f" (and the dump's own peak error ≤ {self.precision_dump_peak:g}×row RMS)"))
        return ", ".join(parts)


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _cross_check(r: ToleranceRule) -> str | None:
    if r.max_ulps is None and r.hard_ulps is None and r.rtol is None and r.atol is None and r.max_rel_l2 is None:
        return "max_ulps, hard_ulps, rtol, atol and max_rel_l2 are all off: such a rule can never fail"
    if r.max_ulps is not None and r.hard_ulps is not None and r.hard_ulps < r.max_ulps:
        return f"hard_ulps ({r.hard_ulps}) is below max_ulps ({r.max_ulps})"
    return None


# ------------------------------------------------------------------------------------------------ table
@dataclass(frozen=True)
class RuleEntry:
    """One table entry: four glob patterns and the rule fields it sets; `source` names where it came from."""

    site: str
    mode: str
    dtype: str
    compute: str
    fields: tuple[tuple[str, Any], ...]
    source: str
    # semantic forks the dump must record for this entry to apply ((fork, value), ...; parity.model.semantics), e.g.
    # (("kda_chunk_precision", "bfloat16"),): a conditional section of the calibration file. An entry with a
    # condition is skipped until `RulesTable.for_semantics` resolves it against a dump's recorded semantics.
    when: tuple[tuple[str, str], ...] = ()

    def matches(self, site: str, mode: str, dtype: str, compute: str) -> bool:
        return all(fnmatch.fnmatchcase(v, p) for v, p in
                   ((site, self.site), (mode, self.mode), (dtype, self.dtype), (compute, self.compute)))


@dataclass(frozen=True)
class RulesTable:
    """Ordered entries; lookup is first-match-wins per field (module docstring)."""

    entries: tuple[RuleEntry, ...] = ()
    # rule_for's results: a replay asks for the same few hundred keys thousands of times, and the table is immutable
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def _resolve(self, site: str, mode: str, dtype: str, compute_dtype: str | None) -> dict[str, tuple[Any, str]]:
        """{field: (value, source entry)} for one key, memoised: `value_for` is asked once per corpus point by the
        calibration pipeline (hundreds of thousands of points, a few hundred distinct keys). Callers must not
        mutate the returned dict."""
        key = ("resolve", site, mode, dtype, compute_dtype)
        got = self._memo.get(key)
        if got is None:
            got = {}
            for e in self.entries:
                if not e.when and e.matches(site, mode, dtype, compute_dtype or ""):
                    for f, v in e.fields:
                        got.setdefault(f, (v, e.source))
            self._memo[key] = got
        return got

    def rule_for(self, site: str, mode: str, dtype: str, compute_dtype: str | None = None) -> ToleranceRule:
        """The rule for one point. Raises ToleranceError if a required field is set by no matching entry."""
        key = (site, mode, dtype, compute_dtype)
        if key not in self._memo:
            self._memo[key] = self._rule_for(site, mode, dtype, compute_dtype)
        return self._memo[key]

    def _rule_for(self, site: str, mode: str, dtype: str, compute_dtype: str | None) -> ToleranceRule:
        got = self._resolve(site, mode, dtype, compute_dtype)
        where = f"site {site!r}, mode {mode!r}, dtype {dtype!r}" + (f", compute {compute_dtype!r}" if compute_dtype else "")
        missing = [f for f in REQUIRED_FIELDS if f not in got]
        if missing:
            raise ToleranceError(f"tolerance rules: no entry sets {', '.join(missing)} for {where}; add a catch-all "
                                 f"entry (site = \"*\", mode = \"*\", dtype = \"{dtype}\")")
        try:
            return ToleranceRule(**{f: v for f, (v, _) in got.items()})
        except ToleranceError as e:
            srcs = "; ".join(f"{f} from {got[f][1]}" for f in RULE_FIELDS if f in got)
            raise ToleranceError(f"tolerance rules for {where}: {e} ({srcs})") from None

    def value_for(self, field: str, site: str, mode: str, dtype: str, compute_dtype: str | None = None) -> Any:
        """One field's value for a point (None if no entry sets it) — for tables that set only some fields, such as
        the safety-bound section of calibration.toml."""
        return self._resolve(site, mode, dtype, compute_dtype).get(field, (None, ""))[0]

    def explain(self, site: str, mode: str, dtype: str, compute_dtype: str | None = None) -> dict[str, str]:
        """{field: source entry} of the fields `rule_for` would use — for 'why this tolerance?' questions."""
        return {f: src for f, (_, src) in self._resolve(site, mode, dtype, compute_dtype).items()}

    def for_semantics(self, semantics: Mapping[str, Any] | None) -> "RulesTable":
        """This table for a dump that records `semantics` (its `semantics` root attr): entries whose condition the
        dump's forks meet apply (in place), the other conditional entries are dropped; unconditional ones stay."""
        sem = semantics or {}
        out = []
        for e in self.entries:
            if not e.when:
                out.append(e)
            elif all(str(sem.get(k)) == v for k, v in e.when):
                out.append(dataclasses.replace(e, when=()))
        return RulesTable(tuple(out))

    def merged(self, other: "RulesTable") -> "RulesTable":
        """A table where `other`'s entries take precedence over this table's."""
        return RulesTable(tuple(other.entries) + tuple(self.entries))


# ------------------------------------------------------------------------------------------------ loading
def _entry(raw: Mapping[str, Any], source: str) -> RuleEntry:
    keys = {k: "*" for k in KEY_FIELDS}
    fields: list[tuple[str, Any]] = []
    for k, v in raw.items():
        try:
            if k in KEY_FIELDS:
                keys[k] = _check_pattern(k, v)
            elif k == "note":
                if not isinstance(v, str):
                    raise ValueError("expected a string")
            else:
                fields.append((k, _check_field(k, v)))
        except ValueError as e:
            raise ToleranceError(f"{source}: field {k!r} = {v!r}: {e}") from None
    if not fields:
        raise ToleranceError(f"{source}: sets no rule field; expected at least one of {', '.join(RULE_FIELDS)}")
    entry = RuleEntry(keys["site"], keys["mode"], keys["dtype"], keys["compute"], tuple(fields), source)
    if all(f in dict(fields) for f in REQUIRED_FIELDS):  # a complete entry must be usable on its own
        try:
            ToleranceRule(**dict(fields))
        except ToleranceError as e:
            raise ToleranceError(f"{source}: {e}") from None
    return entry


def _parse_document(doc: Mapping[str, Any], name: str) -> RulesTable:
    for k in doc:
        if k not in ("schema", "version", "rule"):
            raise ToleranceError(f"{name}: unknown top-level key {k!r}; expected [[rule]] entries (and optional "
                                 f"schema = \"{SCHEMA}\", version = 1)")
    if doc.get("schema", SCHEMA) != SCHEMA:
        raise ToleranceError(f"{name}: schema {doc['schema']!r}, expected {SCHEMA!r}")
    if doc.get("version", 1) != 1:
        raise ToleranceError(f"{name}: version {doc['version']!r}, expected 1")
    rules = doc.get("rule", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise ToleranceError(f"{name}: 'rule' must be an array of tables ([[rule]])")
    return RulesTable(tuple(_entry(r, f"{name} entry {i}") for i, r in enumerate(rules, 1)))


def load_rules(path: str | Path) -> RulesTable:
    """Read a tolerance TOML file. Entry numbers in errors count [[rule]] tables from 1."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ToleranceError(f"{path}: cannot read tolerance file ({e.strerror or e})") from None
    return _parse_text(text, str(path))


def _parse_text(text: str, name: str) -> RulesTable:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ToleranceError(f"{name}: not valid TOML ({e})") from None
    return _parse_document(doc, name)


def parse_calibration(text: str, name: str = CALIBRATION_FILE) -> dict[str, RulesTable]:
    """The sections of a calibration file ({section: table}, in lookup order; module docstring). Entry numbers in
    errors count each section's tables from 1."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ToleranceError(f"{name}: not valid TOML ({e})") from None
    if doc.get("schema") != CALIBRATION_SCHEMA:
        raise ToleranceError(f"{name}: schema {doc.get('schema')!r}, expected {CALIBRATION_SCHEMA!r}")
    if doc.get("version") != 1:
        raise ToleranceError(f"{name}: version {doc.get('version')!r}, expected 1")
    sections = doc.get("sections")
    if not isinstance(sections, list) or not sections or not all(isinstance(x, str) for x in sections):
        raise ToleranceError(f"{name}: 'sections' must be a non-empty list of section names (the lookup order)")
    for k in doc:
        if k not in ("schema", "version", "sections", "when") and k not in sections:
            raise ToleranceError(f"{name}: key {k!r} is not a section listed in 'sections' ({', '.join(sections)})")
    when = doc.get("when", {})
    for sec, cond in when.items() if isinstance(when, dict) else [("", None)]:
        if sec not in sections or not isinstance(cond, dict) or not cond or \
                not all(isinstance(v, str) for v in cond.values()):
            raise ToleranceError(f"{name}: [when.{sec}] must name a listed section and hold the semantic forks it "
                                 f"needs as strings, e.g. kda_chunk_precision = \"bfloat16\"")
    out = {}
    for sec in sections:
        rules = doc.get(sec, [])  # a listed section without entries is empty (nothing derived differs)
        if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
            raise ToleranceError(f"{name}: section {sec!r} must be an array of tables ([[{sec}]])")
        cond = tuple(sorted(when.get(sec, {}).items()))
        out[sec] = RulesTable(tuple(dataclasses.replace(_entry(r, f"{name} {sec} entry {i}"), when=cond)
                                    for i, r in enumerate(rules, 1)))
    return out


def flatten(sections: Mapping[str, RulesTable]) -> RulesTable:
    """One table: the sections' entries in lookup order (an earlier section's entry wins, per field)."""
    return RulesTable(tuple(e for t in sections.values() for e in t.entries))


@functools.lru_cache(maxsize=1)
def calibrated_sections() -> dict[str, RulesTable]:
    """The packaged calibration file's sections (`calibration.toml`; its header says how it was calibrated)."""
    text = resources.files("parity.numerics").joinpath(CALIBRATION_FILE).read_text(encoding="utf-8")
    return parse_calibration(text, CALIBRATION_FILE)


# ------------------------------------------------------------------------------------------------ real widths
REAL_WIDTH_FILE = "real_width.toml"  # hand-written from real-width measurements (its header says which)
# The calibration corpora's checkpoints have hidden size 64; the real-width section applies beyond this width.
TINY_WIDTH_MAX = 256


def width_class(hidden_size: int | None) -> str:
    """"real" for a model wider than the calibration corpora's (`TINY_WIDTH_MAX`), else "tiny" (also when unknown)."""
    return "real" if hidden_size is not None and hidden_size > TINY_WIDTH_MAX else "tiny"


def rule_semantics(semantics: Mapping[str, Any] | None, hidden_size: int | None) -> dict[str, Any]:
    """What a dump's conditional rule sections are resolved against (`RulesTable.for_semantics`): its recorded
    semantic forks (parity.model.semantics) and its width class (`width`, the real-width section's condition)."""
    return {**(semantics or {}), "width": width_class(hidden_size)}


@functools.lru_cache(maxsize=1)
def real_width_rules() -> RulesTable:
    """`real_width.toml`'s conditional section (fp32 floors for dumps wider than the calibration corpora)."""
    text = resources.files("parity.numerics").joinpath(REAL_WIDTH_FILE).read_text(encoding="utf-8")
    return flatten(parse_calibration(text, REAL_WIDTH_FILE))


@functools.lru_cache(maxsize=1)
def default_rules() -> RulesTable:
    """The packaged defaults: the real-width section (`real_width.toml`, conditional on `width = "real"`), then every
    section of `calibration.toml` in its lookup order — the backward phase's gradient rules
    (parity.calibration.gradients: sites `backward/*`, every field set), the conditional real-kernel sections, the
    calibrated tolerance rules (parity.calibration.rules), the per-element safety bounds (parity.calibration.bounds:
    only `bound_rms`) and the isolated-mode exactness rates and norm-scale noise (parity.calibration.exactness_rates).
    Conditional entries apply once a dump's semantics resolve them (`for_semantics(rule_semantics(...))`)."""
    return flatten(calibrated_sections()).merged(real_width_rules())


def with_user_rules(base: RulesTable, tolerances_file: str | None, overrides: list[str] | None) -> RulesTable:
    """`base` with a tolerance file (`--parity-tolerances`) and then one-line overrides (`--parity-tol`) merged over
    it, later ones winning."""
    rules = base
    if tolerances_file:
        rules = rules.merged(load_rules(tolerances_file))
    if overrides:
        rules = rules.merged(parse_overrides(overrides, source="--parity-tol"))
    return rules


def _cli_value(field: str, text: str) -> Any:
    t = text.strip()
    if t.lower() in _OFF or field in ("compare_dtype", "compute"):
        return t
    for parse in ((int, float) if field in ("max_ulps", "hard_ulps") else (float,)):
        try:
            return parse(t)
        except ValueError:
            pass
    return t  # _check_field reports it with what was expected


def parse_override(text: str, source: str = "override") -> RulesTable:
    """One CLI override `SITE:MODE:DTYPE:field=value[,field=value...]` → a one-entry table."""
    parts = text.rsplit(":", 3)
    if len(parts) != 4 or "=" not in parts[3]:
        raise ToleranceError(f"{source} {text!r}: expected SITE:MODE:DTYPE:field=value[,field=value...], e.g. "
                             f"'mlp.*:layer:bfloat16:max_ulps=8,hard_ulps=64'")
    raw: dict[str, Any] = dict(zip(("site", "mode", "dtype"), parts[:3]))
    for item in parts[3].split(","):
        k, eq, v = item.partition("=")
        k = k.strip()
        if not eq or not k:
            raise ToleranceError(f"{source} {text!r}: item {item!r} is not field=value")
        if k in raw:
            raise ToleranceError(f"{source} {text!r}: field {k!r} given twice")
        raw[k] = _cli_value(k, v)
    return RulesTable((_entry(raw, f"{source} {text!r}"),))


def parse_overrides(texts: Iterable[str], source: str = "override") -> RulesTable:
    """Several CLI overrides; a later one takes precedence over an earlier one."""
    table = RulesTable()
    for i, t in enumerate(texts, 1):
        table = table.merged(parse_override(t, f"{source} {i}"))
    return table
