"""The README's test command is what CI runs (.ci/run must run it verbatim)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    assert "requirements/cpu.txt" in main_cmd and "requirements/cpu.txt" in test_cmd
