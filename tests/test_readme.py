"""The README's test command is what CI runs (.ci/run must run it verbatim), and both README commands install the
fully pinned lock, which pins every requirement of pyproject.toml and requirements/cpu.txt."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cpu.lock"
INSTALL = "python3 -m pip install -q -r requirements/cpu.lock -e ."


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", text, flags=re.S)


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert len(cmds) >= 2, f"README must hold the two commands in ```bash blocks, found {len(cmds)}"
    main_cmd, test_cmd = cmds[0].strip(), cmds[1].strip()
    assert "pytest parity" in main_cmd, main_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, f".ci/run does not run the README test command {test_cmd!r}"
    assert main_cmd.startswith(INSTALL + " && ") and test_cmd.startswith(INSTALL + " && "), (main_cmd, test_cmd)


def _lock_pins() -> dict[str, Version]:
    pins = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"{LOCK.name}:{n}: not pinned with ==: {line!r}"
        pins[canonicalize_name(req.name)] = Version(spec[0].version)
    return pins


def _direct_requirements() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [("pyproject.toml dependencies", r) for r in project["dependencies"]]
    reqs += [(f"pyproject.toml [{x}]", r) for x in ("test", "fla") for r in project["optional-dependencies"][x]]
    for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            reqs.append(("requirements/cpu.txt", line.strip()))
    return [(src, Requirement(r)) for src, r in reqs]


def test_the_lock_pins_every_direct_requirement_within_its_range():
    pins = _lock_pins()
    assert len(pins) > 20, pins  # the whole environment, not only the direct requirements
    for src, req in _direct_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{LOCK.name} lacks {req.name} ({src}); run requirements/compile-lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{LOCK.name} pins {req.name}=={pins[name]}, outside {req} ({src}); run requirements/compile-lock.sh")
    assert pins["torch"].local == "cpu", "the lock must pin the CPU build of torch"


def test_the_lock_says_how_it_was_made():
    header = "".join(line for line in LOCK.read_text().splitlines(keepends=True)[:8] if line.startswith("#"))
    assert "requirements/compile-lock.sh" in header and (ROOT / "requirements" / "compile-lock.sh").is_file()


def test_readme_is_short_and_its_first_screen_leads_to_install_run_port_and_failure():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference material to docs/"
    first_screen = "\n".join(lines[:25])
    for anchor in ("#install-and-run", "#use-it-dump-replay-read", "#test-your-port", "#read-a-failure"):
        assert f"]({anchor})" in first_screen, f"README's first 25 lines lack a link to {anchor}"


def test_ci_replays_the_goldens_that_command_two_does_not_collect():
    """Command two collects tests/ only (pyproject's testpaths); the goldens' points are README command one, so CI
    runs `pytest parity` as a step of its own after command two — no golden point goes untested in CI."""
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert opts["testpaths"] == ["tests"], opts["testpaths"]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    test_cmd = _readme_commands()[1].strip()
    i = next(n for n, ln in enumerate(ci) if test_cmd in ln)
    assert any(re.match(r"python3 -m pytest parity( |$)", ln) and "-k" not in ln and "--parity-dump" not in ln
               for ln in ci[i + 1:]), ".ci/run must run `python3 -m pytest parity` (every golden) after command two"
