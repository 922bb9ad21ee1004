"""The collection reads plainly: ruff (pyproject.toml) is clean, and the steps keep the rules a
linter cannot hold (docs/testing.md): few trailing comments, no tag without words, no conditional
expression over several lines or inside another, no lambda that decides or calls a collective; the
README is a map within 100 columns that names no commit."""
import ast
import io
import re
import subprocess
import tokenize

import pytest

from helpers import BIN, REPO
from test_steps_in_line import COLLECTIVES

STEPS = sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py"))
TRAILING = 0.05  # trailing comments, `# collective` and linter directives aside, per code line
LABELS = re.compile(r"# (collective|noqa\b.*)$")
MAX_COMMENT_WORDS = 800


def test_ruff_is_clean():
    proc = subprocess.run([BIN / "ruff", "check", "--no-cache", "."], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout


def comments(path):
    """(trailing comments, full-line comments, code lines) of a script."""
    source = (REPO / path).read_text()
    trailing, alone, code = [], [], set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            (alone if token.line[:token.start[1]].strip() == "" else trailing).append(token)
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER):
            code.update(range(token.start[0], token.end[0] + 1))
    return trailing, alone, code


@pytest.mark.parametrize("path", STEPS)
def test_few_trailing_comments_and_every_tag_has_words(path):
    trailing, alone, code = comments(path)
    other = [t for t in trailing if not LABELS.match(t.string)]
    assert len(other) <= TRAILING * len(code), (
        f"{path}: {len(other)} trailing comments on {len(code)} code lines (at most "
        f"{TRAILING:.0%}): "
        "put a sentence above the paragraph instead\n" + "\n".join(t.line.rstrip() for t in other))
    empty = [t.line.rstrip() for t in trailing + alone
             if re.fullmatch(r"#\s*[\w ./-]+:\s*", t.string)]
    assert not empty, f"{path}: tags without words:\n" + "\n".join(empty)


@pytest.mark.parametrize("path", STEPS)
def test_comments_are_sentences_within_800_words(path):
    """A comment says why in a sentence: no comment line with two colons (`# DDP: a: b`, a
    telegram; code in backticks aside), and at most 800 comment words a step (labels aside; the
    anchors of STYLE.md hold 0-695)."""
    trailing, alone, _ = comments(path)
    telegrams = [t.line.strip() for t in alone
                 if re.sub(r"`[^`]*`", "", t.string).count(":") >= 2]
    assert not telegrams, f"{path}: comments written as telegrams:\n" + "\n".join(telegrams)
    words = sum(len(t.string.lstrip("#").split()) for t in trailing + alone
                if not LABELS.match(t.string))
    assert words <= MAX_COMMENT_WORDS, f"{path}: {words} comment words, at most {MAX_COMMENT_WORDS}"


@pytest.mark.parametrize("path", STEPS)
def test_plain_lines(path):
    """No conditional expression over several lines or inside another; no lambda that calls
    something or calls a collective (name a function instead)."""
    tree = ast.parse((REPO / path).read_text())
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp):
            if node.end_lineno != node.lineno:
                problems.append(f"line {node.lineno}: a conditional expression over several lines")
            if any(isinstance(inner, ast.IfExp) for inner in ast.walk(node) if inner is not node):
                problems.append(f"line {node.lineno}: a conditional expression inside another")
        if isinstance(node, ast.Lambda) and (
                any(isinstance(inner, (ast.IfExp, ast.BoolOp, ast.Compare))
                    for inner in ast.walk(node))
                or COLLECTIVES.search(ast.unparse(node))):
            problems.append(f"line {node.lineno}: a lambda that decides or meets the other ranks: "
                            f"{ast.unparse(node)}")
    assert not problems, f"{path}:\n" + "\n".join(problems)


def test_the_readme_is_a_map():
    """Prose within 100 columns (a table row or a command may be longer), no commit hashes."""
    text = (REPO / "README.md").read_text()
    in_code, long = False, []
    for number, line in enumerate(text.splitlines(), 1):
        in_code ^= line.startswith("```")
        if len(line) > 100 and not in_code and not line.startswith(("|", "```")):
            long.append(f"{number}: {line[:60]}...")
    assert not long, "README prose over 100 columns:\n" + "\n".join(long)
    hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", text)
              if re.search(r"[a-f]", word) and re.search(r"\d", word)]
    assert not hashes, f"the README names commits: {hashes}"


def test_the_suites_own_lists_name_tests_and_files_that_exist():
    """conftest.py's quick tier and load order name tests and files by hand: a renamed test would
    silently leave the quick tier (as the template's stop/resume test once did)."""
    import conftest

    files = {path.stem for path in (REPO / "tests").glob("test_*.py")}
    names = {name for path in (REPO / "tests").glob("test_*.py")
             for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    assert conftest.SLOW_FILES <= files and set(conftest.WEIGHT) <= files
    assert conftest.SLOW_TESTS <= names, sorted(conftest.SLOW_TESTS - names)


def test_nothing_in_the_product_exists_for_the_suites_speed():
    """What a user copies (the steps and common/) does nothing at import but define names and import
    torchvision, and ends through public means: no frozen garbage collector, no stand-in modules,
    no private exit machinery. The suite's speed-ups live in tests/harness/."""
    banned = re.compile(r"gc\.freeze|sys\.modules|threading\._shutdown|atexit\._run_exitfuncs")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in [*REPO.glob("0[1-9]_cifar10_*.py"), *REPO.glob("common/*.py")]
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if banned.search(line)]
    assert not found, "\n".join(found)


# Python's own special names, which any object has: not another library's private ones.
SPECIAL = {*dir(object), *dir(dict), *dir(list), *dir(type), "__file__", "__version__", "__enter__",
           "__exit__"}
# Private names of other libraries that have no public way yet, each in one small named function
# whose comment says what the public way lacks: {script: {name}}.
NO_PUBLIC_WAY = {"05_cifar10_deepspeed.py": {"__compatible_ops__"}}


@pytest.mark.parametrize("path", [*STEPS, *sorted(p.relative_to(REPO).as_posix()
                                                 for p in (REPO / "common").glob("*.py"))])
def test_narrow_functions_and_public_names_only(path):
    """No function takes more than 6 parameters (the anchors' widest), and no code reaches into
    another library by a private name (`x._y`, `x.__y__`; os._exit is public)."""
    tree = ast.parse((REPO / path).read_text())
    wide, private = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            count = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            if count > 6:
                wide.append(f"line {node.lineno}: {node.name} takes {count}")
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and node.attr not in SPECIAL and ast.unparse(node) != "os._exit"
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and node.attr not in NO_PUBLIC_WAY.get(path, ())):
            private.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and "._" in f".{node.module}":
            private.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not wide, f"{path}: functions over 6 parameters:\n" + "\n".join(wide)
    assert not private, f"{path}: private names of another library:\n" + "\n".join(private)
