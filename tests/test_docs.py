"""The docs quote only options that exist, and their internal links resolve.

Options come from the real code: the pytest plugin's (and pytest's own) from `pytest --help`, each tool's from its
argparse `--help` (subcommands included). An option quoted after `tools/NAME.py` must be one of NAME's options; an
option quoted without a command must exist somewhere (plugin, pytest, a tool, or a foreign command listed below).
Links: relative paths must exist, `#anchors` must name a heading of their page (GitHub's slug rules).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

# An option token: `--name-with-dashes`, not followed by a word character (so XLA's `--xla_flags` are not ours).
OPTION = re.compile(r"(?<![\w-])--[A-Za-z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)*(?![\w])")
TOOL = re.compile(r"(?:^|/)tools/(\w+)\.py$")
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Options of commands that are not ours (installing sglang-jax's venv): the only ones allowed without a source.
FOREIGN = {"pip": {"--no-deps", "--ignore-requires-python", "--no-index", "--no-compile", "--no-cache-dir", "--target"}}


def _help(args: list[str]) -> str:
    r = subprocess.run([sys.executable, *args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(args)} --help failed: {r.stderr.strip()[-300:]}"
    return r.stdout


def help_options(text: str) -> set[str]:
    """Options an argparse/pytest help text defines: the left column of its option lines."""
    found: set[str] = set()
    for line in text.splitlines():
        if line.lstrip().startswith("-"):
            found |= set(OPTION.findall(re.split(r"\s{2,}", line.strip())[0]))
    return found


def help_subcommands(text: str) -> list[str]:
    """argparse subcommands, from the usage line's `{a,b,c} ...`."""
    m = re.search(r"\{([\w,-]+)\} \.\.\.", text)
    return m.group(1).split(",") if m else []


@functools.lru_cache(maxsize=None)
def known_options() -> dict[str, set[str]]:
    """Command name -> its options: 'pytest', 'ci_summary', each tool by name, 'tool sub' per subcommand."""
    known = {"pytest": help_options(_help(["-m", "pytest", "-p", "no:cacheprovider"])),
             "ci_summary": help_options(_help(["-m", "parity.pytest_plugin.ci_summary"]))}
    for tool in sorted((ROOT / "tools").glob("*.py")):
        text = _help([f"tools/{tool.name}"])
        known[tool.stem] = help_options(text)
        for sub in help_subcommands(text):
            known[f"{tool.stem} {sub}"] = known[tool.stem] | help_options(_help([f"tools/{tool.name}", sub]))
    known.update(FOREIGN)
    return known


def code_segments(text: str) -> list[str]:
    """Command-like pieces of a page: each (continued) line of a fenced block, and each inline code span."""
    segs = []
    for block in FENCE.findall(text):
        segs += block.replace("\\\n", " ").splitlines()
    segs += [s.replace("\n", " ") for s in INLINE.findall(FENCE.sub("", text))]
    return segs


def option_problems(segment: str, known: dict[str, set[str]]) -> list[str]:
    """Options in one segment that the command they follow (or, with none, any command) does not define."""
    everything = set().union(*known.values())
    problems, cmd = [], None
    tokens = segment.split()
    for i, tok in enumerate(tokens):
        tool = TOOL.search(tok)
        if tool and tool.group(1) in known:
            cmd = tool.group(1)
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            cmd = f"{cmd} {nxt}" if f"{cmd} {nxt}" in known else cmd
        elif tok == "parity.pytest_plugin.ci_summary":
            cmd = "ci_summary"
        elif tok in ("pytest", "pip"):
            cmd = tok
        elif tok in ("&&", "||", "|", ";"):
            cmd = None
        for opt in OPTION.findall(tok):
            if opt.startswith("--parity-") and opt not in known["pytest"]:
                problems.append(f"{opt}: not an option of the pytest plugin")
            elif cmd is not None and opt not in known[cmd]:
                problems.append(f"{opt}: not an option of {cmd}")
            elif cmd is None and opt not in everything:
                problems.append(f"{opt}: no plugin, pytest or tool option of that name")
    return problems


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            if n:
                seen[f"{slug}-{n}"] = 1
    return set(seen)


def link_problems(page: Path) -> list[str]:
    """Internal links of one page that name no file, or an anchor its page lacks."""
    problems = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: link {target!r}: no file {path}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{page.name}: link {target!r}: {dest.name} has no heading with anchor #{anchor}")
    return problems


def test_the_docs_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    want = {"README.md", "dumping.md", "replay.md", "report.md", "porting.md", "numerics.md", "performance.md",
            "troubleshooting.md"}
    assert want <= names, f"docs/ lacks {sorted(want - names)}"


def test_every_option_quoted_in_the_docs_exists_in_the_code():
    known = known_options()
    assert "--parity-dump" in known["pytest"] and "--cpu-kernels" in known["dump_hf"], "help parsing found nothing"
    problems = [f"{page.relative_to(ROOT)}: `{seg.strip()[:80]}`: {p}"
                for page in PAGES for seg in code_segments(page.read_text()) for p in option_problems(seg, known)]
    assert not problems, "options quoted in the docs that the code does not define:\n" + "\n".join(problems)


def test_the_option_check_catches_a_renamed_option():
    known = known_options()
    page = ("Run `python tools/dump_hf.py CKPT --cpu-kernel` then\n```\npytest parity --parity-dumps x.h5\n```\n"
            "and `python tools/report.py show DIR --write` or `--no-such-flag`.")
    problems = [p for seg in code_segments(page) for p in option_problems(seg, known)]
    assert problems == ["--parity-dumps: not an option of the pytest plugin",  # fenced blocks come first
                        "--cpu-kernel: not an option of dump_hf",
                        "--write: not an option of report show",
                        "--no-such-flag: no plugin, pytest or tool option of that name"], problems


def test_every_internal_link_resolves():
    problems = [p for page in PAGES for p in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Some `code` section\n\n[ok](#some-code-section) [ok](b.md#b-title)"
                                   " [bad](b.md#nope) [bad](c.md) [web](https://example.com/x)\n")
    (tmp_path / "b.md").write_text("# B title\n")
    assert link_problems(tmp_path / "a.md") == ["a.md: link 'b.md#nope': b.md has no heading with anchor #nope",
                                                "a.md: link 'c.md': no file c.md"]
