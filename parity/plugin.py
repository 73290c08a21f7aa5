"""The pytest face of the suite (DESIGN §8): options, one test per compared point, reports at the end of the run.

`pytest parity` replays the target against the bundled dumps (or `--parity-dump FILE`); each point is a test whose id
holds the dump, phase/step, `layer_{i}` and the site, e.g. `test_point[tiny-bf16/prefill/layer_3/attention.core]`.
`-k layer_3` selects exactly layer 3 (a plain substring match would also take layer_30..39: the plugin narrows it).
Records travel to the controller through `user_properties`, so `-n auto` (xdist) gives the same reports.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from parity.replay.session import BUNDLED_DUMPS, target_info  # noqa: E402  (checkout or installed data files)
RECORD_KEY = "parity_record"
# `layer` works for every target; `isolated` needs the target's `isolated` capability (external ports often lack it),
# so a run of both is asked for: `--parity-mode layer,isolated` (CI: tests/test_parity_modes.py)
DEFAULT_MODES = "layer"


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("parity", "ling3-parity replay")
    g.addoption("--parity-dump", action="append", default=None,
                help="dump file(s) to replay (default: the bundled dumps in dumps/)")
    g.addoption("--parity-ckpt", default=None,
                help="checkpoint directory (default: found by the dump's fingerprint among dumps/ckpt/*)")
    g.addoption("--parity-target", default="reference",
                help="target: 'reference' (pure-JAX Ling3) or 'package.module:Class' (external adapter)")
    g.addoption("--parity-mode", default=DEFAULT_MODES,
                help="replay mode(s), comma-separated (default: %(default)s; `layer,isolated` = the layer check and the "
                     "fine instrument in one run): layer = teacher forcing per layer; free = run from token ids; forced = layer + "
                     "forced routing; isolated = each sub-module fed its own dumped inputs")
    g.addoption("--parity-tolerances", default=None, help="TOML tolerance rules merged over the defaults")
    g.addoption("--parity-tol", action="append", default=[],
                help="one rule override, e.g. 'mlp.*:layer:bfloat16:max_ulps=8,hard_ulps=64' (repeatable)")
    g.addoption("--parity-report", default="reports",
                help="report directory (one subdirectory per dump); default ./reports of the current directory")
    g.addoption("--parity-mesh", default=None,
                help="shard the target's layer params over a device mesh: auto | N | EXPERTSxHEADS (e.g. 4x2)")
    g.addoption("--parity-layers", default=None, help="layers to replay, e.g. 0-3,7 (default all)")


# ------------------------------------------------------------------------------------------ session state
@dataclass
class DumpEntry:
    """One replay of the run: a dump in one mode. `run` names it in test ids, records and the report directory: the
    dump's label alone when the run has one mode, `label/mode` when it has several."""

    path: Path
    label: str
    mode: str = "layer"
    run: str = ""

    def __post_init__(self) -> None:
        self.run = self.run or self.label


def _dump_label(path: Path) -> str:
    return path.name.removesuffix(".h5")


def parity_modes(config: pytest.Config) -> list[str]:
    """The `--parity-mode` list, validated (a usage error names the bad mode and the valid ones)."""
    from parity.replay import MODES

    text = config.getoption("--parity-mode", default=DEFAULT_MODES) or DEFAULT_MODES
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise pytest.UsageError(f"--parity-mode {text!r}: expected one or more of {', '.join(MODES)}, comma-separated, "
                                f"each once")
    return modes


def selected_dumps(config: pytest.Config) -> list[DumpEntry]:
    given = config.getoption("--parity-dump")
    if given:
        paths = [Path(p) for p in given]
    else:
        paths = sorted(BUNDLED_DUMPS.glob("*.h5"))
    modes = parity_modes(config)
    return [DumpEntry(p, _dump_label(p), m, _dump_label(p) if len(modes) == 1 else f"{_dump_label(p)}/{m}")
            for p in paths for m in modes]


class ParitySession:
    """Per-process cache: opened dumps, one replay `Session` per dump, and the replayed layers' records."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.readers: dict[str, object] = {}
        self.replays: dict[tuple[str, object], dict] = {}
        self.sessions: dict[str, object] = {}
        self.errors: dict[str, tuple[str, bool]] = {}  # label -> (message, is a usage error)

    def reader(self, entry: DumpEntry):
        from parity.dumpfile import DumpReader

        if entry.label not in self.readers:
            self.readers[entry.label] = DumpReader(entry.path)
        return self.readers[entry.label]

    def session(self, entry: DumpEntry):
        if entry.run in self.errors:
            msg, fail = self.errors[entry.run]
            pytest.fail(msg, pytrace=False) if fail else pytest.skip(msg)
        if entry.run in self.sessions:
            return self.sessions[entry.run]
        from parity.errors import TargetError
        from parity.numerics.tolerances import default_rules, load_rules, parse_overrides
        from parity.replay import ModeError, Session

        opt = self.config.getoption
        rules = default_rules()
        if opt("--parity-tolerances"):
            rules = rules.merged(load_rules(opt("--parity-tolerances")))
        if opt("--parity-tol"):
            rules = rules.merged(parse_overrides(opt("--parity-tol")))
        try:
            layers = _parse_layers(opt("--parity-layers"))
            s = Session.open(self.reader(entry), opt("--parity-ckpt"), target=opt("--parity-target"),
                             mode=entry.mode, rules=rules,
                             mesh=getattr(self.config, "_parity_mesh", None),  # mesh built in pytest_configure
                             layers=None if layers is None else sorted(layers))
        except TargetError as e:
            self.errors[entry.run] = (str(e), False)
            pytest.skip(str(e))
        except ModeError as e:
            self.errors[entry.run] = (str(e), True)
            pytest.fail(str(e), pytrace=False)
        self.sessions[entry.run] = s
        return s

    def records(self, entry: DumpEntry, layer) -> dict:
        """{(phase, step, layer, site): report.json record} for one layer (or the model-level points when layer is
        None); free mode replays the whole model once."""
        from parity.replay import judge, observe, observe_free

        key = (entry.run, layer if entry.mode != "free" else "free")
        if key not in self.replays:
            s = self.session(entry)
            obs = observe_free(s) if s.mode == "free" else observe(s, layer)
            recs = [r.to_json() for r in judge(s, obs)]
            self.replays[key] = {(r["phase"], r["step"], r["layer"], r["site"]): r for r in recs}
        return self.replays[key]


def _session(config) -> ParitySession:
    s = getattr(config, "_parity_session", None)
    if s is None:
        s = config._parity_session = ParitySession(config)
    return s


# ------------------------------------------------------------------------------------------ collection
def _parse_layers(text: str | None):
    if not text:
        return None
    from parity.points import parse_layers

    return set(parse_layers(text, option="--parity-layers"))


def parity_params(config: pytest.Config) -> list:
    """One param per (dump, phase, step, layer, site) the dump holds or declares unavailable."""
    from parity.errors import ParityError
    from parity.points import sites_for_config
    from parity.replay import dump_steps

    sess = _session(config)
    layers_opt = _parse_layers(config.getoption("--parity-layers"))
    params = []
    for entry in selected_dumps(config):
        try:
            dump = sess.reader(entry)
        except ParityError as e:
            params.append(pytest.param(entry, None, None, id=f"{entry.run}/unreadable",
                                       marks=pytest.mark.parity_error(str(e))))
            continue
        cfg = dump.config
        steps = dump_steps(dump) or [("prefill", 0)]
        layers = sorted(set(dump.layers("prefill", 0)) - {None})
        if layers_opt is not None:
            layers = [i for i in layers if i in layers_opt]
        for phase, step in steps:
            ph = "prefill" if phase == "prefill" else f"decode_{step}"
            for site in ("embed", "final_norm", "logits"):
                params.append(pytest.param(entry, (phase, step, None, site), None,
                                           id=f"{entry.run}/{ph}/model/{site}",
                                           marks=_xdist_group(entry, None)))
            for i in layers:
                for site in sites_for_config(cfg, i, recorded_inputs=True):
                    params.append(pytest.param(entry, (phase, step, i, site), i,
                                               id=f"{entry.run}/{ph}/layer_{i}/{site}",
                                               marks=_xdist_group(entry, i)))
    return params


def _xdist_group(entry: DumpEntry, layer: int | None):
    """One replay serves every point of a (dump, layer): with -n, its tests run on one worker (under xdist's default
    `load` each worker would replay every layer again). The mark serves an explicit `--dist loadgroup` where pytest
    keeps xdist's id suffix (< 9.2); by default the scheduler reads the same group from the test id
    (parity/xdist_groups.py). Per layer, not per dump, so a big dump's layers still spread over the workers."""
    return pytest.mark.xdist_group(f"parity:{entry.run}:{'model' if layer is None else f'L{layer:02d}'}")


def _dist_given(config: pytest.Config) -> bool:
    """Did the user choose xdist's --dist (command line, PYTEST_ADDOPTS or the ini file's addopts)?"""
    args = (list(config.invocation_params.args) + os.environ.get("PYTEST_ADDOPTS", "").split()
            + list(config.getini("addopts")))
    return any(a in ("-d", "--distload", "--dist") or a.startswith("--dist=") for a in args)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "parity_error(msg): the dump could not be read")
    config.addinivalue_line("markers", "parity_layer(i): a parity test of layer i")
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker (pytest-xdist)")
    config._parity_records = {}
    # xdist's default for -n (`load`) spreads a layer's points over all workers, and each worker then replays that
    # layer: group them per (dump, layer) instead (parity/xdist_groups.py); another explicit --dist is the user's.
    dist = getattr(config.option, "dist", "no")
    config._parity_group_layers = (dist == "load" and not _dist_given(config)) or dist == "loadgroup"
    if config.getoption("--parity-mode", default=None) is not None:
        parity_modes(config)  # a bad mode is one usage error up front
    spec = config.getoption("--parity-mesh", default=None)
    if spec:  # a bad mesh is one usage error up front, not a failure in every test
        from parity.jax_ling3.sharding import mesh_from_spec

        try:
            config._parity_mesh = mesh_from_spec(spec)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist controller: the scheduler that keeps a (dump, layer) on one worker (xdist's loadgroup alone no longer
    does on pytest >= 9.2, see parity/xdist_groups.py)."""
    if getattr(config, "_parity_group_layers", False):
        from parity.xdist_groups import ParityGroupScheduling

        return ParityGroupScheduling(config, log)
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "parity_point" in metafunc.fixturenames:
        metafunc.parametrize("parity_dump,parity_point,parity_layer", parity_params(metafunc.config))


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """`-k layer_3` must not also select layer_30..39: deselect parity items of other layers."""
    expr = config.getoption("keyword") or ""
    wanted = {int(n) for n in re.findall(r"(?<![\w])layer_(\d+)(?![\d])", expr)}
    if not wanted or re.search(r"\bnot\b|\bor\b", expr):
        return
    keep, drop = [], []
    for item in items:
        cs = getattr(item, "callspec", None)
        layer = cs.params.get("parity_layer") if cs else None
        if cs and "parity_point" in cs.params and layer is not None and layer not in wanted:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ------------------------------------------------------------------------------------------ the test body
def run_point(request: pytest.FixtureRequest, entry: DumpEntry, point: tuple, layer) -> None:
    marker = request.node.get_closest_marker("parity_error")
    if marker:
        pytest.fail(marker.args[0], pytrace=False)
    sess = _session(request.config)
    recs = sess.records(entry, layer)
    rec = recs.get(point)
    if rec is None:
        phase, step, lay, site = point
        rec = {"phase": phase, "step": step, "layer": lay, "site": site, "status": "missing",
               "reason": "the replay produced no record for this point"}
    rec = dict(rec, dump=entry.run)
    request.node.user_properties.append((RECORD_KEY, json.dumps(rec, default=_jsonable)))
    status = rec["status"]
    if status == "skipped":
        pytest.skip(rec.get("reason", "skipped"))
    if status in ("fail", "missing"):
        pytest.fail(rec.get("message") or rec.get("reason") or status, pytrace=False)


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


# ------------------------------------------------------------------------------------------ reports
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.when == "setup" and report.skipped):
        return
    for key, value in report.user_properties:
        if key == RECORD_KEY:
            rec = json.loads(value)
            _RECORDS.setdefault(rec["dump"], []).append(rec)


_RECORDS: dict[str, list[dict]] = {}


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    if _is_worker(config) or not _RECORDS:
        return
    from parity.report import build_report, write_reports

    out_root = Path(config.getoption("--parity-report"))
    built, skipped = [], []
    entries = {e.run: e for e in selected_dumps(config)}
    for label, recs in sorted(_RECORDS.items()):
        entry = entries.get(label)
        try:
            cfg = _session(config).reader(entry).config  # the reader the replay used: no second validation pass
        except Exception as e:  # the tests already failed on an unreadable dump; say why it has no report
            skipped.append(f"{label}: no report written ({e})")
            continue
        for r in recs:
            r.pop("dump", None)
        rep = build_report(cfg, recs, dump=str(entry.path), target=config.getoption("--parity-target"),
                           mode=entry.mode)
        sess = _session(config).sessions.get(label)  # this process's session (absent on an xdist controller)
        if sess is not None:  # protocol v2: what actually ran, in the report header
            rep["target_info"] = target_info(sess.target)
        path = write_reports(rep, out_root / label)
        built.append((rep, path))
    config._parity_built = built
    config._parity_report_skipped = skipped


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    built = getattr(config, "_parity_built", None)
    skipped = getattr(config, "_parity_report_skipped", None)
    if not built and not skipped:
        return
    from parity.report import summary_text

    terminalreporter.section("ling3-parity")
    for line in skipped or ():
        terminalreporter.write_line(line)
    for rep, path in built or ():
        terminalreporter.write_line(summary_text(rep))
        terminalreporter.write_line(f"  reports: {path}/report.{{json,md,html}}")
