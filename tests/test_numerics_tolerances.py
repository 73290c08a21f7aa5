"""Tolerance rules: TOML loading, first-match-per-field precedence, merging, CLI overrides, and errors that name the
file, the entry and the field."""

import tomllib
from importlib import resources

import pytest

from parity.errors import ParityError, ToleranceError
from parity.numerics import RulesTable, ToleranceRule, default_rules, load_rules, parse_override, parse_overrides

FULL = "floor_ulps = 1\nmax_ulps = 2\nallowed_fraction = 0.001\nhard_ulps = 64\n"


def write(tmp_path, text, name="tol.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------------------------------- defaults
def test_default_table_loads_and_covers_every_dtype_and_mode():
    t = default_rules()
    for dtype in ("bfloat16", "float16", "float32", "int32", "int64"):
        for mode in ("layer", "forced", "free", "isolated"):
            assert isinstance(t.rule_for("attention.core", mode, dtype), ToleranceRule)
    assert isinstance(t.rule_for("x", "layer", "float32", "float32"), ToleranceRule)


def test_default_table_is_calibrated_and_resolves():
    """The shipped table names the command that calibrated it (DESIGN §5) and resolves every mode × tier."""
    text = resources.files("parity.numerics").joinpath("default_tolerances.toml").read_text()
    assert "PROVISIONAL" not in text and "Calibrated by `python tools/calibrate.py" in text
    tomllib.loads(text)  # valid TOML
    t = default_rules()
    for mode in ("layer", "forced", "free"):
        for dtype, compute in (("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float32")):
            r = t.rule_for("mlp.down_proj", mode, dtype, compute)
            assert r.max_ulps is not None or r.rtol is not None, (mode, dtype, compute)
    # every tensor is judged in the precision it was computed in: fp32 tensors of a bf16 run on the fp32 grid
    # (issue 15; never rounded to bf16 first), the fp32 tier (compute float32) on its own grid
    for mode in ("layer", "forced", "free", "isolated"):
        for dtype, compute in (("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float32")):
            assert t.rule_for("mlp.gate.logits", mode, dtype, compute).compare_dtype is None, (mode, dtype, compute)
    tier = t.rule_for("mlp.gate.logits", "layer", "float32", "float32")
    assert tier.compare_dtype is None and tier.rtol == 1e-5


# ------------------------------------------------------------------------------------------- precedence
TABLE = f"""
[[rule]]
site = "mlp.gate.*"
mode = "layer"
dtype = "bfloat16"
max_ulps = 8

[[rule]]
site = "mlp.*"
dtype = "bfloat16"
max_ulps = 4
hard_ulps = 128

[[rule]]
dtype = "bfloat16"
{FULL}
[[rule]]
site = "attention.dense:in"
max_ulps = 99
"""


def test_first_match_wins_per_field(tmp_path):
    t = load_rules(write(tmp_path, TABLE))
    r = t.rule_for("mlp.gate.logits", "layer", "bfloat16")
    assert (r.max_ulps, r.hard_ulps, r.floor_ulps) == (8, 128, 1.0)  # entry 1, entry 2, entry 3
    r = t.rule_for("mlp.gate.logits", "free", "bfloat16")
    assert (r.max_ulps, r.hard_ulps) == (4, 128)
    r = t.rule_for("attention.core", "layer", "bfloat16")
    assert (r.max_ulps, r.hard_ulps) == (2, 64)
    # entry 4 comes after the catch-all: its max_ulps is shadowed
    assert t.rule_for("attention.dense:in", "layer", "bfloat16").max_ulps == 2
    assert t.explain("mlp.gate.logits", "layer", "bfloat16")["max_ulps"].endswith("entry 1")
    assert t.explain("mlp.gate.logits", "layer", "bfloat16")["floor_ulps"].endswith("entry 3")


def test_order_decides(tmp_path):
    a = f'[[rule]]\ndtype = "bfloat16"\n{FULL}\n[[rule]]\nsite = "mlp"\nmax_ulps = 7\n'
    b = f'[[rule]]\nsite = "mlp"\nmax_ulps = 7\n\n[[rule]]\ndtype = "bfloat16"\n{FULL}'
    assert load_rules(write(tmp_path, a, "a.toml")).rule_for("mlp", "layer", "bfloat16").max_ulps == 2
    assert load_rules(write(tmp_path, b, "b.toml")).rule_for("mlp", "layer", "bfloat16").max_ulps == 7


def test_merged_overrides_win(tmp_path):
    base = load_rules(write(tmp_path, TABLE))
    assert base.rule_for("mlp.gate.logits", "layer", "bfloat16").max_ulps == 8  # memoised per table, not shared
    over = load_rules(write(tmp_path, '[[rule]]\nsite = "*"\nmax_ulps = 16\n', "o.toml"))
    m = base.merged(over)
    assert m.rule_for("mlp.gate.logits", "layer", "bfloat16").max_ulps == 16
    assert m.rule_for("mlp.gate.logits", "layer", "bfloat16").hard_ulps == 128  # untouched fields still cascade
    assert base.rule_for("mlp.gate.logits", "layer", "bfloat16").max_ulps == 8  # immutable


def test_compute_pattern_matches_only_when_given(tmp_path):
    text = f'[[rule]]\ncompute = "float32"\nmax_ulps = "off"\nhard_ulps = "off"\nrtol = 1e-5\n\n[[rule]]\n{FULL}'
    t = load_rules(write(tmp_path, text))
    assert t.rule_for("x", "layer", "float32").max_ulps == 2
    r = t.rule_for("x", "layer", "float32", "float32")
    assert r.max_ulps is None and r.hard_ulps is None and r.rtol == 1e-5


def test_missing_required_field_at_lookup(tmp_path):
    t = load_rules(write(tmp_path, '[[rule]]\ndtype = "bfloat16"\nmax_ulps = 3\n'))
    with pytest.raises(ToleranceError, match=r"no entry sets floor_ulps, allowed_fraction, hard_ulps for site 'x'"):
        t.rule_for("x", "layer", "bfloat16")
    with pytest.raises(ToleranceError, match=r"no entry sets floor_ulps, max_ulps, .*dtype 'float16'"):
        t.rule_for("x", "layer", "float16")


def test_cross_field_problem_at_lookup_names_the_sources(tmp_path):
    t = load_rules(write(tmp_path, f'[[rule]]\nsite = "mlp"\nhard_ulps = 1\n\n[[rule]]\n{FULL}'))
    with pytest.raises(ToleranceError, match=r"hard_ulps \(1\) is below max_ulps \(2\).*hard_ulps from .*entry 1"):
        t.rule_for("mlp", "layer", "bfloat16")


# ------------------------------------------------------------------------------------------- CLI overrides
def test_parse_override():
    t = parse_override("mlp.*:layer:bfloat16:max_ulps=8,hard_ulps=64")
    (e,) = t.entries
    assert (e.site, e.mode, e.dtype, e.compute) == ("mlp.*", "layer", "bfloat16", "*")
    assert dict(e.fields) == {"max_ulps": 8, "hard_ulps": 64}
    # a site that contains ':' and off values, compute among the fields
    (e,) = parse_override("attention.dense:in:*:float32:hard_ulps=off,rtol=1e-5,compute=float32").entries
    assert (e.site, e.mode, e.dtype, e.compute) == ("attention.dense:in", "*", "float32", "float32")
    assert dict(e.fields) == {"hard_ulps": None, "rtol": 1e-5}


def test_overrides_applied_over_defaults():
    t = default_rules().merged(parse_overrides(["mlp.*:layer:bfloat16:max_ulps=8", "mlp.up_proj:*:*:max_ulps=9"]))
    assert t.rule_for("mlp.down_proj", "layer", "bfloat16").max_ulps == 8
    assert t.rule_for("mlp.up_proj", "layer", "bfloat16").max_ulps == 9  # later override wins
    assert t.rule_for("attention.core", "layer", "bfloat16") == default_rules().rule_for("attention.core", "layer",
                                                                                         "bfloat16")


@pytest.mark.parametrize("text, pattern", [
    ("mlp.*:layer:bfloat16", r"expected SITE:MODE:DTYPE:field=value"),
    ("mlp.*:layer:bfloat16:max_ulps=abc", r"field 'max_ulps' = 'abc': expected an integer"),
    ("mlp.*:layer:bfloat16:max_ulps=2.5", r"field 'max_ulps' = 2.5: expected an integer"),
    ("mlp.*:layer:bf16:max_ulps=2", r"field 'dtype' = 'bf16': expected one of bfloat16"),
    ("mlp.*:layer:bfloat16:maxulps=2", r"field 'maxulps'.*unknown field"),
    ("mlp.*:layer:bfloat16:max_ulps=2,max_ulps=3", r"'max_ulps' given twice"),
    ("mlp.*:layer:bfloat16:allowed_fraction=2", r"allowed_fraction.*expected a number in \[0, 1\]"),
    ("mlp.*:layer:bfloat16:max_ulps=off,hard_ulps=off", r"never fail"),  # incomplete entries are checked at lookup
])
def test_bad_overrides(text, pattern):
    with pytest.raises(ToleranceError, match=pattern):
        t = parse_override(text)
        RulesTable(t.entries + default_rules().entries).rule_for("mlp.x", "layer", "bfloat16")


# ------------------------------------------------------------------------------------------- file errors
@pytest.mark.parametrize("text, pattern", [
    ("[[rule]\n", r"not valid TOML"),
    ('[[rule]]\nsite = "*"\n' + FULL + '\n[[rule]]\nsite = "mlp"\nmax_ulp = 3\n', r"entry 2: field 'max_ulp'.*unknown"),
    ('[[rule]]\n' + FULL + '\n[[rule]]\nmax_ulps = -1\n', r"entry 2: field 'max_ulps' = -1: expected an integer"),
    ('[[rule]]\ndtype = "fp32"\n' + FULL, r"entry 1: field 'dtype' = 'fp32'"),
    ('[[rule]]\nsite = 3\n' + FULL, r"entry 1: field 'site' = 3: expected a non-empty glob"),
    ('[[rule]]\nfloor_ulps = "off"\n', r"entry 1: field 'floor_ulps' = 'off': expected a finite number"),
    ('[[rule]]\nsite = "x"\n', r"entry 1: sets no rule field"),
    ('[[rule]]\nfloor_ulps = 1\nmax_ulps = 8\nallowed_fraction = 0\nhard_ulps = 4\n', r"entry 1: .*hard_ulps \(4\) "
     r"is below max_ulps \(8\)"),
    ('[[rule]]\nfloor_ulps = 1\nmax_ulps = "off"\nallowed_fraction = 0\nhard_ulps = "off"\n', r"entry 1: .*never fail"),
    ('[[rule]]\ncompare_dtype = "float64"\n', r"entry 1: field 'compare_dtype'"),
    ('rules = []\n', r"unknown top-level key 'rules'"),
    ('schema = "other"\n', r"schema 'other'"),
    ('rule = 3\n', r"array of tables"),
])
def test_bad_files_name_file_entry_and_field(tmp_path, text, pattern):
    p = write(tmp_path, text, "bad.toml")
    with pytest.raises(ToleranceError, match=pattern) as ei:
        load_rules(p)
    assert str(p) in str(ei.value)
    assert isinstance(ei.value, ParityError) and "\n" not in str(ei.value).split(": not valid TOML")[0]


def test_missing_file(tmp_path):
    with pytest.raises(ToleranceError, match=r"nope\.toml: cannot read tolerance file"):
        load_rules(tmp_path / "nope.toml")


def test_rule_constructor_validates():
    with pytest.raises(ToleranceError, match="allowed_fraction"):
        ToleranceRule(1, 2, 1.5, 64)
    with pytest.raises(ToleranceError, match="never fail"):
        ToleranceRule(1, None, 0.0, None)
    assert ToleranceRule(0, None, 0.0, None, rtol=1e-5).has_allclose
