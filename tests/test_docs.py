"""The documentation holds: every relative link in README.md, CHANGELOG.md and docs/*.md resolves (the file,
and the ``#anchor`` where one is given), the Python blocks marked runnable run on a CPU, every ``ampkit VERB``
command shown parses with the CLI's parser, docs/TRAINING.md lists every ``ampkit train`` flag, docs/api.md
names objects that exist, and neither the pages nor the tests' docstrings speak of the project's history
(work stages, rounds, issue numbers) instead of what is.

A block is runnable when the line right before its opening fence is ``<!-- runnable -->``; it runs in a fresh
interpreter with this checkout on ``PYTHONPATH``, CUDA hidden and a private ``$AMPKIT_CACHE_DIR``. No network,
no mkdocs needed.
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
#: wording of a development log: sessions, rounds and issue numbers belong in the changelog or nowhere
DEV_LOG = re.compile(r"\bstop \d+\b|\bthis round\b|\blast round\b|\bbefore this fix\b|\bissues? #?\d+\b"
                     r"|\b(?:this|an earlier|earlier) session\b", re.IGNORECASE)

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)


def prose_lines(text):
    """(line number, line) of the text outside fenced code blocks, inline code removed."""
    fence = None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or (m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence) and not m.group(3).strip())):
            fence = m.group(2) if fence is None else None
            continue
        if fence is None:
            yield no, re.sub(r"(`+)(?:(?!\1).)+?\1", "", line)


def code_blocks(text):
    """(line number of the opening fence, info string, code, the line before the fence) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(2), m.group(3).strip(), i
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and not lines[j].strip()[len(fence):].strip("`~ ")):
            j += 1
        yield start + 1, info, "\n".join(lines[i + 1:j]) + "\n", lines[i - 1].strip() if i else ""
        i = j + 1


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    """Every anchor a page offers: its headings' slugs (repeats get -1, -2, as GitHub numbers them) and
    explicit ``<a id=...>`` / ``<a name=...>`` targets."""
    seen, found = {}, set()
    for _, line in _heading_lines(text):
        base = slug(line)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    found.update(_HTML_ID.findall(text))
    return found


def _heading_lines(text):
    fence = None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or (m.group(2)[0] == fence[0] and not m.group(3).strip())):
            fence = m.group(2) if fence is None else None
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fence is None and h:
            yield no, h.group(1)


def broken_links(page, root=ROOT):
    """'page:line: link: why' for each relative link of ``page`` that does not resolve."""
    text = page.read_text()
    problems = []
    for no, line in prose_lines(text):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{no}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{where}: no heading or <a id> with anchor #{anchor} in {dest.name}")
    return problems


def runnable_blocks(page):
    return [(no, code) for no, info, code, before in code_blocks(page.read_text())
            if before == RUNNABLE and info.split()[:1] == ["python"]]


def dev_log_wording(text):
    return [m.group(0) for m in DEV_LOG.finditer(text)]


def _test_docstrings():
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", doc


# ---------------------------------------------------------------- the checks, on the real pages

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260, "README.md is the front door: move reference text to docs/"
    assert runnable_blocks(ROOT / "README.md"), "the README's five-line loop is marked <!-- runnable -->"
    linked = {Path(t.partition("#")[0]).name for _, line in prose_lines(readme) for t in _LINK.findall(line)}
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked | {"index.md"})
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


BLOCKS = [(page, no, code) for page in PAGES for no, code in runnable_blocks(page)]


@pytest.mark.parametrize("page,line,code", BLOCKS, ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in BLOCKS])
def test_runnable_block_runs_on_cpu(page, line, code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", AMPKIT_CACHE_DIR=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{page.relative_to(ROOT)}:{line} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_say_what_is_not_its_history(page):
    hits = [f"line {no}: {w!r}" for no, line in enumerate(page.read_text().splitlines(), 1)
            for w in dev_log_wording(line)]
    assert not hits, f"{page.relative_to(ROOT)}: development-log wording (say what is; history: CHANGELOG.md): {hits}"


def test_test_docstrings_say_what_is_tested_not_its_history():
    hits = [f"{where}: {w!r}" for where, doc in _test_docstrings() for w in dev_log_wording(doc)]
    assert not hits, "development-log wording in test docstrings:\n" + "\n".join(hits)


# ---------------------------------------------------------------- the checkers can fail

def test_checkers_find_what_is_wrong(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Same\n\n## Same\n\n<a id=\"kept\"></a>\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page: one `title`\n\n"
        "[ok](other.md) [ok](other.md#same-1) [ok](other.md#kept) [ok](#page-one-title) [web](https://x.org/y)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [bad own](#nowhere)\n"
        "`[in code](missing-too.md)`\n\n```python\n[also code](missing-three.md)\n```\n"
        "<!-- runnable -->\n```python\nprint(1)\n```\n\n```python\nprint(2)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ")[1] for p in problems] == ["missing.md", "other.md#nowhere", "#nowhere"], problems
    assert [code for _, code in runnable_blocks(page)] == ["print(1)\n"]
    assert dev_log_wording("as at stop 13, this round; before this fix (Issue 23 item 7)") == [
        "stop 13", "this round", "before this fix", "Issue 23"]
    assert dev_log_wording("one step of the loop; the issue is the scale; stop at 13") == []


# ---------------------------------------------------------------- the API reference's targets exist

def api_targets(text):
    """(dotted path, [members listed under it]) of each mkdocstrings ``::: path`` block of a page."""
    out = []
    for m in re.finditer(r"^::: *([\w.]+)\n((?:[ \t]+.*\n)*)", text, re.MULTILINE):
        members = re.findall(r"^\s+- (\w+)\s*$", m.group(2), re.MULTILINE)
        out.append((m.group(1), members))
    return out


def resolve(path):
    """The object ``path`` names (a module, or an attribute of the longest importable module prefix)."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_api_reference_names_what_exists():
    """docs/api.md names objects and members that exist, so `make docs` renders them (mkdocs is not needed here)."""
    targets = api_targets((ROOT / "docs" / "api.md").read_text())
    assert len(targets) >= 10
    missing = []
    for path, members in targets:
        try:
            obj = resolve(path)
        except (ImportError, AttributeError) as e:
            missing.append(f"{path}: {type(e).__name__}: {e}")
            continue
        missing += [f"{path}.{m}" for m in members if not hasattr(obj, m)]
    assert not missing, f"docs/api.md names what ampkit does not have: {missing}"


def test_api_targets_are_read_with_their_members():
    text = "# T\n\n::: pkg.Cls\n    options:\n      members:\n        - one\n        - two\n\n::: pkg.func\n"
    assert api_targets(text) == [("pkg.Cls", ["one", "two"]), ("pkg.func", [])]
    with pytest.raises(AttributeError):
        resolve("ampkit.Precision.no_such_member")


# ---------------------------------------------------------------- the commands shown are the CLI's

def cli_lines(text):
    """(line number, argv after ``ampkit``) of each ``ampkit VERB ...`` command in a page's shell blocks
    (also under ``torchrun ... -m ampkit``), with comments and line continuations handled."""
    import shlex

    from ampkit.cli import VERBS

    out = []
    for no, info, code, _ in code_blocks(text):
        if info.split()[:1] not in ([], ["bash"], ["sh"], ["shell"]):
            continue
        for i, line in enumerate(code.replace("\\\n", " ").splitlines()):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for k in range(len(words)):
                if words[k] == "ampkit" and (k == 0 or words[k - 1] == "-m") and k + 1 < len(words) \
                        and words[k + 1] in VERBS:
                    out.append((no + 1 + i, words[k + 1:]))
                    break
    return out


def test_commands_in_the_pages_parse():
    """Every ``ampkit VERB ...`` line of README.md and docs/ parses with ampkit's own parser (flags renamed
    or removed fail here); nothing is run."""
    import contextlib
    import io

    from ampkit.cli import _build_parser

    parser = _build_parser()
    bad, seen = [], 0
    for page in PAGES:
        for no, argv in cli_lines(page.read_text()):
            seen += 1
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    parser.parse_args(argv)
            except SystemExit:
                bad.append(f"{page.relative_to(ROOT)}:{no}: ampkit {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1]}")
    assert seen >= 20
    assert not bad, "\n".join(bad)


def test_train_flags_are_all_in_training_md():
    """docs/TRAINING.md's flag tables name every flag `ampkit train` takes."""
    import argparse

    from ampkit.cli import train

    p = argparse.ArgumentParser()
    train.add_parser(p)
    page = (ROOT / "docs" / "TRAINING.md").read_text()
    missing = [o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"
               and f"`{o}`" not in page]
    assert not missing, f"ampkit train flags docs/TRAINING.md does not list: {missing}"


def test_cli_lines_are_found_and_a_wrong_flag_fails():
    text = ("```bash\nampkit train --epochs 2   # comment\ntorchrun --nproc-per-node 2 -m ampkit check \\\n"
            "    --precision bf16\nampkit plan: not a command\n```\n```python\nampkit train --nope\n```\n")
    assert cli_lines(text) == [(2, ["train", "--epochs", "2"]), (3, ["check", "--precision", "bf16"])]
    from ampkit.cli import _build_parser

    with pytest.raises(SystemExit):
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):
            _build_parser().parse_args(["train", "--no-such-flag"])
