"""The pytest face of the suite (DESIGN §8): options, one test per compared site, reports at the end of the run.

`pytest parity` replays the target against the bundled dumps (or `--parity-dump FILE`); each site of each layer is a
test covering every step of the dump (prefill, decode_1, ...), whose id holds the dump, `layer_{i}` and the site,
e.g. `test_point[tiny-bf16/layer_3/attention.core]`; a failure names each failing point with its step.
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

from parity.model import families
from parity.replay.session import BUNDLED_DUMPS, dump_identity, target_info
from parity.pytest_plugin.kimi import RECORD_KEY as KIMI_RECORD_KEY
from parity.pytest_plugin.kimi import is_kimi, kimi_units, run_kimi_unit  # noqa: F401 (run_kimi_unit: parity/test_points.py)
RECORD_KEY = "parity_record"
# `layer` works for every target; `isolated` needs the target's `isolated` capability (external ports often lack it),
# so a run of both is asked for: `--parity-mode layer,isolated` (CI: tests/test_parity_modes.py)
DEFAULT_MODES = "layer"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("parity_xdist_group_files", type="bool", default=False,
                  help="with -n: schedule the tests that are not parity points one test file per worker (as --dist "
                       "loadfile), parity points per (dump, layer) as always")
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
    g.addoption("--parity-semantics", default="dump", choices=("dump", "intended"),
                help="behaviour of the reference target on the semantic forks (SwiGLU clamp, KDA gate/beta "
                     "precision): the dump's recorded runtime (default) or the model's intended one; where the dump "
                     "departs, differences the fork explains are reported as `semantic`, not failures")
    g.addoption("--parity-strict-variants", action="store_true", default=False,
                help="fail points that match a named implementation variant (e.g. an RMSNorm that rounds once, "
                     "bf16(x·(r·w))) instead of reporting them as `variant` (counted as passing): for bit parity "
                     "with HF")
    g.addoption("--parity-matmul-precision", default=None, choices=("default", "high", "highest"),
                help="JAX matmul precision every target call runs under (jax.default_matmul_precision): highest "
                     "(the default: the dumps' fp32 matmuls are IEEE fp32), high, or default (JAX's own setting: "
                     "one bf16 pass for fp32 dots on TPU); recorded in report.json `replay_env`")
    g.addoption("--parity-stall-timeout", default=None, type=float, metavar="SECONDS",
                help="a target call (one layer, step, method) that has not returned after this long fails, naming it, "
                     "with every thread's Python and native stacks (default 600; 0 = no limit)")


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


def _safe_label(text: str) -> str:
    """A label is a test-id part and a report subdirectory: one harmless path component (never '', '.', '..')."""
    lab = re.sub(r"[^A-Za-z0-9._+-]", "_", text).lstrip(".")
    return lab or "dump"


def dump_labels(paths: list[Path]) -> list[str]:
    """One unique label per dump: the file name without `.h5`; dumps sharing a name get their folder's name too
    (`tiny-bf16@before`, `tiny-bf16@after`), and a number if that is not enough."""
    stems = [_safe_label(p.name.removesuffix(".h5")) for p in paths]
    labels = [st if stems.count(st) == 1 else f"{st}@{_safe_label(p.resolve().parent.name)}"
              for p, st in zip(paths, stems)]
    out, seen = [], {}
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if labels.count(lab) == 1 else f"{lab}-{seen[lab]}")
    return out


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
        paths, seen = [], set()
        for p in map(Path, given):  # the same file twice is refused up front (pytest_sessionstart)
            if p.resolve() not in seen:
                seen.add(p.resolve())
                paths.append(p)
    else:
        paths = sorted((BUNDLED_DUMPS / families.LING3.goldens).glob("*.h5"))
    paths = [p for p in paths if families.of_dump(p).replay == __name__]  # another family's replay has its own tests
    modes = parity_modes(config)
    return [DumpEntry(p, lab, m, lab if len(modes) == 1 else f"{lab}/{m}")
            for p, lab in zip(paths, dump_labels(paths)) for m in modes]


def kimi_dumps(config: pytest.Config) -> list[Path]:
    """The Kimi Linear dumps of the run (`parity.pytest_plugin.kimi`): those among --parity-dump, else the bundled
    ones (`dumps/kimi/*.h5`, `parity.golden.KIMI_GOLDEN`: a folder of their own, so that what reads every Ling3
    golden in `dumps/*.h5` does not meet them)."""
    given = config.getoption("--parity-dump")
    paths = list(dict.fromkeys(Path(p) for p in given)) if given else \
        sorted((BUNDLED_DUMPS / families.KIMI_LINEAR.goldens).glob("*.h5"))
    return [p for p in paths if is_kimi(p)]


class ParitySession:
    """Per-process cache: opened dumps, one replay `Session` per dump, and the replayed layers' records."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.readers: dict[str, object] = {}
        self.replays: dict[tuple[str, object], dict] = {}
        self.sessions: dict[str, object] = {}
        self.errors: dict[str, tuple[str, bool]] = {}  # label -> (message, is a usage error)
        self._watchdog = None
        self.stalls: dict[tuple, str] = {}
        self.call_errors: dict[tuple, object] = {}  # replay unit -> the TargetCallError its replay raised
        self.call_errors_told: set[tuple] = set()  # units whose usage error a test has already reported
        # runs (dump entries) with a backward point among the tests that will run (None: not yet known): a replay of
        # a run without one skips the backward phase's work (`Session.backward_off`) — its points are never reported
        self.backward_runs: set[str] | None = None

    def reader(self, entry: DumpEntry):
        from parity.dumpfile import DumpReader

        if entry.label not in self.readers:
            self.readers[entry.label] = DumpReader(entry.path)
        return self.readers[entry.label]

    def watchdog(self):
        """One watchdog per process: after a stall, every later target call of the run fails at once."""
        if self._watchdog is None:
            from parity.replay.watchdog import DEFAULT_LIMIT_S, Watchdog

            limit = self.config.getoption("--parity-stall-timeout")
            self._watchdog = Watchdog(DEFAULT_LIMIT_S if limit is None else limit,
                                      out_dir=self.config.getoption("--parity-report"))
        return self._watchdog

    def rules(self):
        from parity.numerics.tolerances import with_user_rules

        opt = self.config.getoption
        return with_user_rules(families.LING3.entry("rules")(), opt("--parity-tolerances"), opt("--parity-tol"))

    def open_session(self, entry: DumpEntry):
        """Open (and build the target for) one dump's replay session; ParityError with one line when it cannot."""
        from parity.replay import Session

        opt = self.config.getoption
        layers = _parse_layers(opt("--parity-layers"))
        s = Session.open(self.reader(entry), opt("--parity-ckpt"), target=opt("--parity-target"),
                         mode=entry.mode, rules=self.rules(),
                         mesh=getattr(self.config, "_parity_mesh", None),  # mesh built in pytest_configure
                         layers=None if layers is None else sorted(layers), watchdog=self.watchdog(),
                         semantics=opt("--parity-semantics"),
                         strict_variants=opt("--parity-strict-variants"),
                         matmul_precision=opt("--parity-matmul-precision"))
        self.sessions[entry.run] = s
        return s

    def session(self, entry: DumpEntry):
        """The dump's session (opened up front by pytest_sessionstart, or here in an xdist worker). A session that
        cannot be opened fails every test of the dump with the same one line (never a skip: a target that cannot be
        built must not give a green run)."""
        from parity.errors import ParityError

        if entry.run in self.errors:
            raise ParityError(self.errors[entry.run][0])
        if entry.run in self.sessions:
            return self.sessions[entry.run]
        try:
            return self.open_session(entry)
        except ParityError as e:
            self.errors[entry.run] = (str(e), True)
            raise

    def release_others(self, run: str) -> None:
        """Release the weights of every other dump's target before this one replays, so a run over several large
        dumps holds one dump's globals (embedding, LM head) at a time; a dump met again reloads them. A process near
        the kernel's limit on memory mappings drops jax's compiled programs first (`parity.memory_maps`: past the
        limit, XLA's next compilation segfaults)."""
        from parity.memory_maps import release_if_near_limit

        release_if_near_limit()
        for other, s in self.sessions.items():
            if other != run and hasattr(s.target, "release"):
                s.target.release()

    def records(self, entry: DumpEntry, layer) -> dict:
        """{(phase, step, layer, site): report.json record} for one layer (or the model-level points when layer is
        None); free mode replays the whole model once."""
        from parity.replay import judge, observe_free, unit_records

        from parity.errors import TargetCallError
        from parity.replay.watchdog import StallError

        whole = entry.mode == "free" and not isinstance(layer, str)  # free mode: one run of the main stack; MTP apart
        key = (entry.run, "free" if whole else layer)
        if key in self.stalls:
            raise StallError(self.stalls[key])
        if key in self.call_errors:
            raise self.call_errors[key]
        if key not in self.replays:
            s = self.session(entry)
            if self.backward_runs is not None and entry.run not in self.backward_runs:
                s.backward_off = ("no backward point of this dump is among the tests this run runs (-k, -m, "
                                  "--deselect or a skip mark): the backward phase is not computed")
            self.release_others(entry.run)
            try:
                recs = [r.to_json() for r in (judge(s, observe_free(s)) if whole else unit_records(s, layer))]
                _mark_provenance(s.target, recs)
                _independent_sources(s, layer, recs)
            except StallError as e:  # every test of this layer fails with the same line
                self.stalls[key] = str(e)
                raise
            except TargetCallError as e:  # one usage error for the unit, its other points not tested (run_point)
                self.call_errors[key] = e
                raise
            self.replays[key] = {(r["phase"], r["step"], r["layer"], r["site"]): r for r in recs}
        return self.replays[key]


def _mark_provenance(target, recs: list[dict]) -> None:
    """Per-point provenance (port / reference) of a composed target (issue 32, parity.targets.partial)."""
    from parity.targets.base import mark_provenance

    mark_provenance(target, recs)


def _independent_sources(s, layer, recs: list[dict]) -> None:
    """After a failing layer: its failing sub-modules re-run on their own dumped inputs (issue 32,
    parity.replay.independent), each failing record marked `independent_source`."""
    from parity.replay.independent import annotate

    annotate(s, layer, recs)


def _session(config) -> ParitySession:
    s = getattr(config, "_parity_session", None)
    if s is None:
        s = config._parity_session = ParitySession(config)
    return s


# ------------------------------------------------------------------------------------------ collection
def _parse_layers(text: str | None):
    if not text:
        return None
    from parity.model.points import parse_layers

    return set(parse_layers(text, option="--parity-layers"))


@dataclass(frozen=True)
class PointGroup:
    """What one parity test checks: one site of one replay unit (a layer `i`, "model", or an MTP layer "MTP{j}") at
    every step the dump was made with (prefill, decode_1, ...), in step order. `unknown`: lines for points the dump
    holds that are not points of its model (not in `points`: the test fails naming them; nothing replays them)."""

    site: str
    points: tuple  # ((phase, step, layer, site), ...)
    unknown: tuple = ()


def parity_params(config: pytest.Config) -> list:
    """One param per (dump, replay unit, site) a replay of each dump owes (`parity.replay.coverage`): every site of
    every layer of the dump's model, covering every step it was made with, and any other point the dump holds.
    Points not compared by choice (the dump's own --layers/--sites, --parity-layers) get no test: the report lists
    them as not tested.

    Why not one test per (step, site): pytest's own cost per test (~1 ms on a 2-core machine) was a third of a warm
    `pytest parity` run over the bundled dumps (5,105 tests); the steps of a site replay together anyway (one replay
    per layer), and report.json still holds one record per point."""
    from parity.errors import ParityError
    from parity.model.points import mtp_site
    from parity.replay.coverage import owed_points

    sess = _session(config)
    layers_opt = _parse_layers(config.getoption("--parity-layers"))
    params = []
    for entry in selected_dumps(config):
        try:
            owed = owed_points(sess.reader(entry), layers_opt)
        except ParityError as e:  # refused up front (pytest_sessionstart) unless run without it, e.g. in a worker
            params.append(pytest.param(entry, None, None, id=f"{entry.run}/unreadable",
                                       marks=pytest.mark.parity_error(str(e))))
            continue
        groups: dict[tuple, tuple] = {}  # (id part of the unit, site) -> (unit, points, unknown lines); owed order
        for o in owed:
            if o.not_tested:
                continue
            p = o.point
            mtp = mtp_site(p.site)  # an MTP layer's point: its own replay unit "MTP{j}", id .../MTP0/<site>
            unit = p.layer if mtp is None else f"MTP{mtp[0]}"
            lay = ("model" if p.layer is None else f"layer_{p.layer}") if mtp is None else None
            if p.phase == "backward":  # its own tests: `-k backward` selects the phase, `-k layer_3` still the layer
                lay = "backward" if lay is None else f"backward/{lay}"  # an MTP layer's: .../backward/MTP0/<site>
            _, pts, unknown = groups.setdefault((lay, p.site), (unit, [], []))
            if not o.unknown:
                pts.append((p.phase, p.step, p.layer, p.site))
            else:
                unknown.append(f"{entry.path}: holds {p.key()}, which is not a point of its model (layer kinds and "
                               "sites of parity/model/points.py): no replay compares it")
        for (lay, site), (unit, pts, unknown) in groups.items():
            params.append(pytest.param(entry, PointGroup(site, tuple(pts), tuple(unknown)), unit,
                                       id="/".join(x for x in (entry.run, lay, site) if x),
                                       marks=[_xdist_group(entry, unit)]))
    return params


def _xdist_group(entry: DumpEntry, layer: int | str | None):
    """One replay serves every point of a (dump, layer): with -n, its tests run on one worker (under xdist's default
    `load` each worker would replay every layer again). The mark serves an explicit `--dist loadgroup` where pytest
    keeps xdist's id suffix (< 9.2); by default the scheduler reads the same group from the test id
    (parity/pytest_plugin/xdist_groups.py). Per layer, not per dump, so a big dump's layers still spread over the workers."""
    unit = "model" if layer is None else layer if isinstance(layer, str) else f"L{layer:02d}"
    return pytest.mark.xdist_group(f"parity:{entry.run}:{unit}")


def _dist_given(config: pytest.Config) -> bool:
    """Did the user choose xdist's --dist (command line, PYTEST_ADDOPTS or the ini file's addopts)?"""
    args = (list(config.invocation_params.args) + os.environ.get("PYTEST_ADDOPTS", "").split()
            + list(config.getini("addopts")))
    return any(a in ("-d", "--distload", "--dist") or a.startswith("--dist=") for a in args)


def _runs_parity(config: pytest.Config) -> bool:
    """Does this run collect the parity tests (`pytest parity`, `pytest` with the ini's testpaths, a port's
    `pytest --pyargs parity`)? Only then are the parity options and dumps checked up front."""
    import importlib.util

    test_file = (Path(__file__).parents[1] / "test_points.py").resolve()
    for arg in config.args:
        path = arg.split("::", 1)[0]
        if config.option.pyargs:
            try:
                spec = importlib.util.find_spec(path)
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.origin:
                path = str(Path(spec.origin).parent if spec.submodule_search_locations else spec.origin)
        p = (Path(config.invocation_params.dir) / path).resolve()
        if p == test_file or p in test_file.parents:
            return True
    return False


def _up_front(config: pytest.Config) -> None:
    """Every option, dump, checkpoint and the target checked once, before any test: a problem is one usage error
    (one line, exit status 4), never a traceback or a skip per test (DESIGN §10). In one process the sessions opened
    here serve the tests; an xdist controller checks everything but the target's build (its workers build)."""
    from parity.errors import ParityError
    from parity.replay.session import prepare

    opt = config.getoption
    sess = _session(config)
    seen: dict[Path, str] = {}
    for p in map(Path, opt("--parity-dump") or ()):
        if p.resolve() in seen:
            raise pytest.UsageError(f"--parity-dump {p}: given twice (also as {seen[p.resolve()]})")
        seen[p.resolve()] = str(p)
    entries = selected_dumps(config)
    if not entries and not kimi_dumps(config):
        raise pytest.UsageError(f"no dump to replay: no --parity-dump and no *.h5 in {BUNDLED_DUMPS}")
    build = not (hasattr(config, "workerinput") or getattr(config.option, "dist", "no") != "no"
                 or config.getoption("collectonly"))
    try:
        layers = _parse_layers(opt("--parity-layers"))
        sess.rules()
        for entry in entries:
            reader = sess.reader(entry)
            n = reader.config.num_hidden_layers
            if layers is not None and not layers <= set(range(n)):
                raise ParityError(f"--parity-layers {opt('--parity-layers')!r}: layer(s) "
                                  f"{sorted(layers - set(range(n)))} not in the model of {entry.path} "
                                  f"(layers 0..{n - 1})")
            if build:
                sess.open_session(entry)
            else:
                prepare(reader, opt("--parity-ckpt"), target=opt("--parity-target"), mode=entry.mode)
    except ParityError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if not hasattr(config, "workerinput") and _runs_parity(config):
        _up_front(config)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "parity_error(msg): the dump could not be read")
    config.addinivalue_line("markers", "parity_layer(i): a parity test of layer i")
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker (pytest-xdist)")
    config._parity_records = {}
    # xdist's default for -n (`load`) spreads a layer's points over all workers, and each worker then replays that
    # layer: group them per (dump, layer) instead (parity/pytest_plugin/xdist_groups.py); another explicit --dist is the user's.
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
    does on pytest >= 9.2, see parity/pytest_plugin/xdist_groups.py)."""
    if getattr(config, "_parity_group_layers", False):
        from parity.pytest_plugin.xdist_groups import ParityGroupScheduling

        return ParityGroupScheduling(config, log)
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "parity_points" in metafunc.fixturenames:
        metafunc.parametrize("parity_dump,parity_points,parity_layer", parity_params(metafunc.config))
    if "parity_kimi_unit" in metafunc.fixturenames:
        config = metafunc.config
        paths = kimi_dumps(config)
        layers = _parse_layers(config.getoption("--parity-layers"))
        units = [u for u in kimi_units(paths, dump_labels(paths), parity_modes(config))
                 if layers is None or u.values[0].layer in layers]
        metafunc.parametrize("parity_kimi_unit", units)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Which runs have a backward point among the tests that will run (after -k / -m / --deselect, skip marks
    counted): a run without one replays its units without the backward phase (a unit's replay computes every phase,
    and only the points that run are reported). `pytest parity -k "not backward"` then costs a forward replay only."""
    runs = set()
    for item in session.items:
        cs = getattr(item, "callspec", None)
        group = cs.params.get("parity_points") if cs else None
        if group is None or item.get_closest_marker("skip") is not None:
            continue
        if any(p[0] == "backward" for p in group.points):
            runs.add(cs.params["parity_dump"].run)
    _session(session.config).backward_runs = runs


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
        if cs and "parity_points" in cs.params and layer is not None and layer not in wanted:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ------------------------------------------------------------------------------------------ the test body
def run_point(request: pytest.FixtureRequest, entry: DumpEntry, group: PointGroup, layer) -> None:
    """Judge every step of one (dump, unit, site): each point's record goes to the report; the test fails if any
    point failed or is missing (one line per such point, each naming its step), is skipped if every point was."""
    marker = request.node.get_closest_marker("parity_error")
    if marker:
        pytest.fail(marker.args[0], pytrace=False)
    from parity.errors import ParityError

    sess = _session(request.config)
    props = request.node.user_properties
    from parity.errors import TargetCallError

    try:
        recs = sess.records(entry, layer)
    except TargetCallError as e:
        _target_call_failed(sess, entry, group, layer, e, props)
    except ParityError as e:  # the session could not be opened, or a target call stalled: a failure on record
        for phase, step, lay, site in group.points:
            rec = {"phase": phase, "step": step, "layer": lay, "site": site, "status": "fail", "reason": str(e),
                   "message": str(e), "dump": entry.run}
            props.append((RECORD_KEY, json.dumps(rec, default=_jsonable)))
        pytest.fail(str(e), pytrace=False)
    failures, skips = list(group.unknown), []
    for point in group.points:
        rec = recs.get(point)
        if rec is None:
            from parity.model.points import Point

            p = Point(*point)
            why = ("the dump lacks it (its model has this point at a step the dump was made with; deleted or lost?)"
                   if not sess.reader(entry).has(p) else "the replay produced no record for this point")
            rec = {"phase": p.phase, "step": p.step, "layer": p.layer, "site": p.site, "status": "missing",
                   "reason": why, "message": f"{entry.run}: {p.key()} missing: {why}"}
        props.append((RECORD_KEY, json.dumps(dict(rec, dump=entry.run), default=_jsonable)))
        status = rec["status"]
        if status in ("fail", "missing"):
            failures.append(rec.get("message") or rec.get("reason") or status)
        elif status == "skipped":
            skips.append(rec.get("reason", "skipped"))
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    if skips and len(skips) == len(group.points):  # every step skipped (some skipped ones beside passes: report.json)
        pytest.skip("; ".join(dict.fromkeys(skips)))


def _target_call_failed(sess: ParitySession, entry: DumpEntry, group: PointGroup, layer, err, props: list) -> None:
    """A target call raised while replaying this test's unit: the first test of the unit fails with ONE usage-error
    line (the layer, the call, the exception's last frame); every point of the unit is recorded as not tested with
    that reason (report.json `target_errors` lists the error once), and the unit's other tests are skipped."""
    key = (entry.run, layer)
    told = key in sess.call_errors_told
    sess.call_errors_told.add(key)
    why = f"not tested: {err}"
    for phase, step, lay, site in group.points:
        rec = {"phase": phase, "step": step, "layer": lay, "site": site, "status": "not-tested", "reason": why,
               "target_error": err.to_dict(), "dump": entry.run}
        props.append((RECORD_KEY, json.dumps(rec, default=_jsonable)))
    if told:
        pytest.skip(f"{err.where}: not tested (the target call {err.call} raised; reported once for this unit)")
    pytest.fail(f"usage error: {err} — the unit's other points are not tested", pytrace=False)


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
        elif key == KIMI_RECORD_KEY:
            rec = json.loads(value)
            _KIMI_RECORDS.setdefault(rec["label"], []).append(rec)


_RECORDS: dict[str, list[dict]] = {}
_KIMI_RECORDS: dict[str, list[dict]] = {}  # Kimi Linear dumps' site records (`parity.pytest_plugin.kimi`)


def _write_kimi_reports(config: pytest.Config) -> None:
    """report.json / .md / .html per Kimi dump (and mode: `reports/<dump>[/<mode>]/`, as a Ling3 run nests them),
    and a summary line per report for the terminal."""
    from parity.pytest_plugin import kimi
    from parity.reporting.report import write_reports

    lines = []
    built = []
    target = config.getoption("--parity-target") or "reference"
    for label, recs in sorted(_KIMI_RECORDS.items()):
        reps = kimi.reports(recs, target)
        for mode, rep in reps.items():
            out = Path(config.getoption("--parity-report")) / label / (mode if len(reps) > 1 else "")
            rep["report_dir"] = str(out)
            built.append((rep, write_reports(rep, out)))
            lines += [kimi.summary_line(label, rep), f"  report: {out / 'report.html'}"]
    _triage(built)  # an fp32 + bf16 pair of one checkpoint: semantic vs precision, per site (as for Ling3)
    for rep, _ in built:  # a pair's triage is in both its reports: said once, with the bf16 one
        if rep.get("dump_dtype") == "bfloat16" and (tri := rep.get("triage")) and (
                tri.get("first_semantic") or tri.get("first_precision")):
            from parity.reporting.report import triage_lines

            lines += [f"{rep['mode']} mode:"] + triage_lines(tri)
    config._parity_kimi_lines = lines


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


COMPARED = ("pass", "fail", "benign", "semantic", "variant")


def _is_fed(rec: dict) -> bool:
    """A point teacher forcing feeds from the dump rather than computes (no comparison): a layer's forward `input`,
    and in the backward phase a layer's `output` cotangent and the model's `embed` cotangent (issue 26)."""
    from parity.model.points import BACKWARD_FED

    if rec.get("phase") == "backward":
        return rec.get("site") in BACKWARD_FED
    return rec.get("site") == "input" and rec.get("layer") is not None


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    if not _is_worker(config) and _KIMI_RECORDS:
        _write_kimi_reports(config)
    if _is_worker(config) or not _RECORDS:
        return
    from parity.replay.coverage import not_tested_records
    from parity.reporting.report import build_report, write_reports

    out_root = Path(config.getoption("--parity-report"))
    built, skipped = [], []
    entries = {e.run: e for e in selected_dumps(config)}
    layers_opt = _parse_layers(config.getoption("--parity-layers"))
    statuses: dict[str, int] = {}
    compared = 0
    for label, recs in sorted(_RECORDS.items()):
        entry = entries.get(label)
        fed = entry is None or entry.mode != "free"  # teacher forcing feeds a layer its dumped `input`
        dump_compared = 0
        for r in recs:
            statuses[r.get("status")] = statuses.get(r.get("status"), 0) + 1
            dump_compared += r.get("status") in COMPARED and not (fed and _is_fed(r))
        compared += dump_compared
        try:
            reader = _session(config).reader(entry)  # the reader the replay used: no second validation pass
            cfg = reader.config
        except Exception as e:  # the tests already failed on an unreadable dump; say why it has no report
            skipped.append(f"{label}: no report written ({e})")
            continue
        for r in recs:
            r.pop("dump", None)
        recs = recs + not_tested_records(reader, {(r["phase"], r["step"], r["layer"], r["site"]) for r in recs},
                                         layers_opt)
        from parity.model.semantics import report_section

        from parity.reporting.repro import run_context

        rep = build_report(cfg, recs, dump=str(entry.path), target=config.getoption("--parity-target"),
                           mode=entry.mode, extra={"semantics": report_section(
                               reader.semantics, config.getoption("--parity-semantics"), recs),
                               **dump_identity(reader),
                               # what tools/repro.py and the reproduce command need (checkpoint, tolerances, report dir)
                               **run_context(reader, config.getoption("--parity-ckpt"),
                                             config.getoption("--parity-tolerances"), config.getoption("--parity-tol"),
                                             out_root / label),
                               "dump_provenance": reader.kernels})  # None: not recorded (older dump)
        rep.update(_target_environment(config))
        if not dump_compared:
            rep["passed"] = False
            rep["note"] = "no point of this dump was compared"
        sess = _session(config).sessions.get(label)  # this process's session (absent on an xdist controller)
        if sess is not None:  # protocol v2: what actually ran, in the report header
            rep["target_info"] = target_info(sess.target)
        from parity.replay.environment import collect
        from parity.replay.matmul_policy import resolve_policy

        # where the target ran (issue 31); an xdist controller's own process: the same machine and environment
        rep["replay_env"] = collect(resolve_policy(config.getoption("--parity-matmul-precision")))
        path = write_reports(rep, out_root / label)  # labels are one safe path component (dump_labels)
        built.append((rep, path))
    if not compared:
        # a run that compared nothing is not a pass (a target that produces nothing, everything skipped; a layer's
        # `input` fed from the dump is no comparison)
        n = sum(statuses.values())
        reasons = sorted({r.get("reason", "") for recs in _RECORDS.values() for r in recs if r.get("reason")})
        skipped.insert(0, f"FAILED: no point was compared ({n} parity point(s) ran: {statuses}"
                          + (f"; e.g. {reasons[0]}" if reasons else "") + ")")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _triage(built)
    config._parity_built = built
    config._parity_report_skipped = skipped


def _target_environment(config) -> dict:
    """report.json `target_environment`: the values of the environment variables the target class declares
    (`Target.environment`), for the reproduce line and repro bundles; {} when it declares none."""
    from parity.errors import ParityError
    from parity.targets import resolve
    from parity.targets.base import target_environment

    try:
        env = target_environment(resolve(config.getoption("--parity-target")))
    except ParityError:  # the tests already failed on a target that cannot be resolved
        return {}
    return {"target_environment": env} if env else {}


def _triage(built: list) -> None:
    """fp32 + bf16 dumps of one checkpoint replayed in this run (same target and mode): each report of a pair gets
    the per-site triage (parity.reporting.triage), rewritten in place."""
    from parity.reporting.report import write_reports
    from parity.reporting.triage import pairs, triage

    paths = {id(rep): path for rep, path in built}
    for fp32, bf16 in pairs([rep for rep, _ in built]):
        tri = triage(fp32, bf16)
        for rep in (fp32, bf16):
            if "triage" not in rep:  # an fp32 dump paired with several bf16 dumps keeps the first triage
                rep["triage"] = tri
                write_reports(rep, paths[id(rep)])


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    kimi_lines = getattr(config, "_parity_kimi_lines", None)
    if kimi_lines:
        terminalreporter.section("ling3-parity: Kimi Linear")
        for line in kimi_lines:
            terminalreporter.write_line(line)
    built = getattr(config, "_parity_built", None)
    skipped = getattr(config, "_parity_report_skipped", None)
    if not built and not skipped:
        return
    from parity.reporting.report import summary_text

    terminalreporter.section("ling3-parity")
    for line in skipped or ():
        terminalreporter.write_line(line)
    for rep, path in built or ():
        terminalreporter.write_line(summary_text(rep))
        from parity.reporting.report import port_lines

        for line in port_lines(rep):
            terminalreporter.write_line(line)
        from parity.model.semantics import report_lines

        for line in report_lines(rep.get("semantics")):
            terminalreporter.write_line(line)
        nt = [r for r in rep["points"] if r.get("status") == "not-tested"]
        if nt:
            why: dict[str, int] = {}
            for r in nt:
                why[r.get("reason", "")] = why.get(r.get("reason", ""), 0) + 1
            terminalreporter.write_line(f"  NOT TESTED: {len(nt)} point(s) — " + "; ".join(
                f"{n}: {w}" for w, n in sorted(why.items(), key=lambda kv: -kv[1])))
        terminalreporter.write_line(f"  reports: {path}/report.{{json,md,html}}")
