"""Adjacent steps stay in line, and a step's diff is its lesson.

A step's lesson lines carry a marker comment naming it (`# DDP: ...`), on the statement itself or in the comment
right above it; lines that must differ but teach nothing (a rank-0 guard, a launch option) carry `# plumbing: ...`.
This test diffs adjacent scripts statement by statement (a statement split over several lines is one) and
  * counts what a method's diff adds that is not its lesson: plumbing, unmarked statements (re-signed or moved code),
    the older step's marker on a new line; at most 15% of the statements it adds (imports aside),
  * fails an unmarked change that is more than plumbing by its shape (the same statement with other arguments or
    targets): a changed learning rate, an evaluation fixed in one script only, a drifted checkpoint call,
  * demands that every call where the ranks meet (a collective) says so: `collective` in its marker,
  * keeps 01 -> 02 and 02 -> 03 as short as they are, every script within its length (01: 180 lines; a later step:
    225 lines that are not its own lesson, so that its method never has to move out to fit), the same sections in the
    same order, and the names of common/ that a reader looks up to follow a step at 16 or fewer.
"""
import ast
import difflib
import re
import subprocess

import pytest

from helpers import REPO

# (base script, step script, marker of the step's lesson)
PAIRS = [
    ("01_cifar10_cpu.py", "02_cifar10_gpu.py", "GPU:"),
    ("02_cifar10_gpu.py", "03_cifar10_dataparallel.py", "DataParallel:"),
    ("03_cifar10_dataparallel.py", "04_cifar10_ddp.py", "DDP:"),
    ("04_cifar10_ddp.py", "05_cifar10_deepspeed.py", "DeepSpeed:"),
    ("04_cifar10_ddp.py", "06_cifar10_horovod.py", "Horovod:"),
    ("04_cifar10_ddp.py", "07_cifar10_apex.py", "Apex:"),
    ("04_cifar10_ddp.py", "08_cifar10_fsdp.py", "FSDP:"),
]
SHORT = {"02_cifar10_gpu.py": 38, "03_cifar10_dataparallel.py": 34}  # changed lines: as short as they were
NOT_LESSON = 0.15  # most of a method's added statements that may be something else than its lesson
PLUMBING = "plumbing:"
MARKERS = {step: marker for _, step, marker in PAIRS}  # a script's own lesson marker
MAX_LINES_01, MAX_NOT_LESSON = 180, 225  # 01's lines; a later step's lines that are not its lesson
MAX_NAMES = 16  # ARCHS: resnet18, cnn, cnn_bn
MAX_COMMON = 1200  # lines in all of common/
SECTIONS = ["argument parsing", "process/device setup", "data", "model", "optimizer and schedule",
            "train one epoch", "evaluate", "checkpoint", "main"]
# Calls where every rank must take part. From 04 on, a backward pass is one too (the gradients' all-reduce).
COLLECTIVES = re.compile(r"\bdist\.(all_reduce|broadcast\w*|barrier|new_group|all_gather\w*|monitored_barrier)\(|"
                         r"\bhvd\.(allreduce\w*|broadcast\w*|barrier|allgather\w*)\(|\bdcp\.(save|load)\(|"
                         r"\bstop\.(requested|leave)\(|\.(save|load)_checkpoint\(|safe_get_full_fp32_param\(|"
                         r"\b(get|set)_(model|optimizer)_state_dict\(model|fully_shard\(|DistributedDataParallel\(")
BACKWARD = re.compile(r"\.backward\(")


def statements(path):
    """The script after its docstring as (statement, its comments, the comments of the blocks it sits in): a statement
    split over several lines is one; its comments are those on it and the comment block right above it; a block
    header other than a def (`if ...:  # DDP: ...`) marks the block it opens."""
    source = (REPO / path).read_text()
    tree = ast.parse(source)
    start = tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0
    found, current, depth, comments, headers = [], [], 0, [], []  # headers: (indent, what marks their block)
    for raw in source.splitlines()[start:]:
        if not current and raw.strip().startswith("#"):
            comments.append(raw.strip())
            continue
        if not current:
            indent = len(raw) - len(raw.lstrip())
        code = raw.split("#", 1)[0] if not raw.lstrip().startswith(("'", '"', "f'", 'f"')) else raw
        current.append(raw.strip())
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0 and not code.rstrip().endswith("\\"):
            joined = " ".join(part for part in current if part)
            if joined:
                headers = [(level, text) for level, text in headers if level < indent]
                own, outer = " ".join(comments), " ".join(text for _, text in headers)
                found.append((joined, own, outer, len(current) + len(comments)))
                if joined.split("  #")[0].rstrip().endswith(":") and not joined.startswith("def "):
                    headers.append((indent, f"{joined} {own} {outer}"))
            current, depth, comments = [], 0, []
    return found


def carries(statement, marker, own_only=False):
    """Whether a statement carries `# marker`: on it, in the comment right above it, or (not own_only) on a header of a
    block it sits in."""
    text, own, outer = statement[:3]
    return f"# {marker}" in text or f"# {marker}" in own or (not own_only and f"# {marker}" in outer)


def shape(line):
    """A statement with its strings blanked, argument lists emptied and assignment targets dropped (`return x` is
    `= x`)."""
    code = re.sub(r"""f?(["'])(?:\\.|(?!\1).)*\1""", '""', line.split("  #", 1)[0].strip())
    code = re.sub(r"^return ", "= ", code)
    previous = None
    while previous != code:
        previous, code = code, re.sub(r"\([^()]*\)", "<args>", code)
    return re.sub(r"^[\w\s,.\[\]]+=(?!=)\s*", "= ", code)


def is_import(line):
    return line.startswith(("import ", "from "))


def added(base, step):
    """The statements (with their comments) that `step` adds or changes against `base`, and the statements of `base`
    they replace, as difflib's blocks: [(removed, added)]."""
    a, b = statements(base), statements(step)
    matcher = difflib.SequenceMatcher(None, [s[0] for s in a], [s[0] for s in b], autojunk=False)
    return [(a[i1:i2], b[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def unexplained_changes(base, step, marker):
    """Changed statements that carry no marker of the step and no plumbing marker, and are more than imports or
    re-plumbed statements (the same shapes as the ones they replace)."""
    problems = []
    for removed, new in added(base, step):
        old_shapes = [shape(s[0]) for s in removed]
        for statement in new:
            if carries(statement, marker) or carries(statement, PLUMBING) or is_import(statement[0]):
                continue
            if shape(statement[0]) in old_shapes:
                old_shapes.remove(shape(statement[0]))
                continue
            problems.append(f"{base} -> {step}: + {statement[0]}")
    return problems


def not_the_lesson(base, step, marker):
    """(the statements `step` adds that are not its lesson, every statement it adds), imports aside."""
    new = [s for _, block in added(base, step) for s in block if not is_import(s[0])]
    return [s[0] for s in new if not carries(s, marker) or carries(s, PLUMBING, own_only=True)], new


def present(pairs):
    return [pytest.param(*p, id=p[1][:2]) for p in pairs]


@pytest.mark.parametrize("base,step,marker", present(PAIRS))
def test_every_difference_is_the_lesson(base, step, marker):
    problems = unexplained_changes(base, step, marker)
    assert not problems, (f"changes without a '# {marker}' marker on the statement or the comment above it (drift, "
                          "or a lesson line missing its comment):\n" + "\n".join(problems))


@pytest.mark.parametrize("base,step,marker", present(PAIRS[2:]))
def test_what_is_not_the_lesson_is_at_most_15_percent_of_a_method_diff(base, step, marker):
    other, new = not_the_lesson(base, step, marker)
    print(f"{base} -> {step}: {len(new)} statements added, {len(other)} not marked '# {marker}'")
    assert len(other) <= NOT_LESSON * len(new), (f"{len(other)} of {len(new)} added statements are not the lesson "
                                                 "(move them to common/ or the earliest step, or drop them):\n"
                                                 + "\n".join(other))


def changed_lines(base, step):
    """What `diff base step | grep -c '^[<>]'` prints."""
    out = subprocess.run(["diff", base, step], cwd=REPO, stdout=subprocess.PIPE, text=True).stdout
    return sum(line.startswith(("<", ">")) for line in out.splitlines())


@pytest.mark.parametrize("base,step,marker", present(PAIRS[:2]))
def test_the_first_diffs_stay_as_short_as_they_are(base, step, marker):
    assert changed_lines(base, step) <= SHORT[step], changed_lines(base, step)


def lines_not_the_lesson(path):
    """The script's lines, less those of the statements (and the comments above them) that it adds or changes against
    its predecessor and that carry its own marker, not plumbing's: a marker on code that is the predecessor's, or on a
    block header over it, does not make that code the lesson."""
    base = next((base for base, step, _ in PAIRS if step == path), None)
    new = [found for _, block in added(base, path) for found in block] if base else []
    lesson = sum(found[3] for found in new if carries(found, MARKERS[path]) and not carries(found, PLUMBING, True))
    return len((REPO / path).read_text().splitlines()) - lesson


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_every_script_is_within_its_length(path):
    """Every line of 01; of a later step, what is not its lesson: the predecessor's code, plumbing, its docstring."""
    count, limit = lines_not_the_lesson(path), MAX_LINES_01 if path.startswith("01_") else MAX_NOT_LESSON
    assert count <= limit, f"{path}: {count} lines that are not its lesson, limit {limit} (move plumbing to common/)"


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[4-9]_cifar10_*.py")))
def test_every_collective_says_so(path):
    """Every statement where the ranks meet says `collective` in its marker: a reader who edits the loop sees every
    place where one rank skipping a call would leave the others waiting."""
    silent = silent_collectives(path)
    assert not silent, "\n".join(silent)


def silent_collectives(path):
    return [s for s, own, outer, _ in statements(path)
            if (COLLECTIVES.search(s.split("  #")[0]) or BACKWARD.search(s.split("  #")[0]))
            and "collective" not in s.split("  #", 1)[-1] and "collective" not in own + outer]


def common_names(path):
    """The names of common/ a reader looks up to follow `path`: module.attribute references and names imported."""
    tree = ast.parse((REPO / path).read_text())
    modules, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common"):
            if node.module == "common":
                modules |= {alias.asname or alias.name for alias in node.names}
            else:
                names |= {alias.asname or alias.name for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            names.add(f"{node.value.id}.{node.attr}")
    return names


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_a_reader_looks_up_at_most_16_names_of_common(path):
    names = common_names(path)
    print(f"{path}: {len(names)} names of common/: {sorted(names)}")
    assert len(names) <= MAX_NAMES, sorted(names)


# What would make common/ do a method's work: importing a parallelism library, or meeting the other ranks (issue 38's
# grep, and any use of torch.distributed).
METHOD_OR_COLLECTIVE = re.compile(r"import deepspeed|horovod|apex|distributed.checkpoint|fsdp|all_reduce|broadcast|"
                                  r"barrier|new_group|all_gather|torch\.distributed|\bdist\.")


def test_common_is_small_and_does_no_method_work():
    """common/ reads the data, builds the models, writes the checkpoint format, the schedule, the command line and the
    log: at most MAX_COMMON lines, no parallelism library, no torch.distributed (so no collective); its comments and
    docstrings may name them."""
    import io
    import tokenize

    files = sorted((REPO / "common").glob("*.py"))
    total = sum(len(path.read_text().splitlines()) for path in files)
    assert total <= MAX_COMMON, f"common/ has {total} lines, at most {MAX_COMMON}"
    found = []
    for path in files:
        source = path.read_text()
        docstrings = {node.body[0].lineno for node in ast.walk(ast.parse(source)) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node, clean=False) is not None}
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.start[0] in docstrings):
                continue
            if METHOD_OR_COLLECTIVE.search(token.string):
                found.append(f"{path.name}:{token.start[0]}: {token.line.strip()}")
    assert not found, "\n".join(found)


def test_common_check_finds_a_collective(tmp_path, monkeypatch):
    """The check above is not blind: a collective in a copy of common/ fails it."""
    import shutil

    shutil.copytree(REPO / "common", tmp_path / "common")
    metrics = tmp_path / "common" / "metrics.py"
    metrics.write_text(re.sub(r"COLLECTIVE = .*", "COLLECTIVE = torch.distributed.all_reduce  # a collective",
                              metrics.read_text()))
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    with pytest.raises(AssertionError, match="metrics.py:.*all_reduce"):
        test_common_is_small_and_does_no_method_work()


def test_unmarked_drift_is_caught(tmp_path, monkeypatch):
    """The check itself can fail: an unmarked change of a hyper-parameter is reported."""
    drifted = (REPO / "02_cifar10_gpu.py").read_text().replace("WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1",
                                                               "WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 1e-4, 1")
    (tmp_path / "02_cifar10_gpu.py").write_text(drifted)
    (tmp_path / "01_cifar10_cpu.py").write_text((REPO / "01_cifar10_cpu.py").read_text())
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    problems = unexplained_changes("01_cifar10_cpu.py", "02_cifar10_gpu.py", "GPU:")
    assert len(problems) == 1 and "1e-4" in problems[0]


def test_the_readme_counts_each_method_diff_as_it_is():
    """The README's statement counts of the method diffs are this test's, not an older version's."""
    text = " ".join((REPO / "README.md").read_text().split())
    said = {"04": re.search(r"the DDP lesson: (\d+) statements, (\d+) not the lesson", text).groups(),
            "05": re.search(r"05 adds or changes (\d+) statements \((\d+) of them not the lesson\)", text).groups(),
            **{n: re.search(rf"\b{n} (\d+) \((\d+)\)", text).groups() for n in ("06", "07", "08")}}
    for base, step, marker in PAIRS[2:]:
        other, new = not_the_lesson(base, step, marker)
        assert said[step[:2]] == (str(len(new)), str(len(other))), (step, said[step[:2]], len(new), len(other))


def test_a_lesson_line_without_its_marker_counts_against_the_diff(tmp_path, monkeypatch):
    """The budget can fail: 04's markers stripped, its diff is mostly not the lesson and every line counts against its
    length; a collective stripped of its marker is named; markers on block headers do not shorten the count."""
    source, honest = (REPO / "04_cifar10_ddp.py").read_text(), lines_not_the_lesson("04_cifar10_ddp.py")
    (tmp_path / "04_cifar10_ddp.py").write_text(re.sub(r"# DDP:", "# note:", source))
    (tmp_path / "03_cifar10_dataparallel.py").write_text((REPO / "03_cifar10_dataparallel.py").read_text())
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    other, new = not_the_lesson("03_cifar10_dataparallel.py", "04_cifar10_ddp.py", "DDP:")
    assert len(other) == len(new) > 20
    assert lines_not_the_lesson("04_cifar10_ddp.py") == len(source.splitlines())  # the length counts every line then
    # A marker on block headers over 03's own code does not make that code 04's lesson: only the headers themselves.
    marked, headers = re.subn(r"^(\s*for .*:)$", r"\1  # DDP: loop", source, flags=re.M)
    (tmp_path / "04_cifar10_ddp.py").write_text(marked)
    assert headers and honest - headers <= lines_not_the_lesson("04_cifar10_ddp.py") < honest
    (tmp_path / "04_cifar10_ddp.py").write_text(source.replace("collective", "meeting"))
    silent = silent_collectives("04_cifar10_ddp.py")
    assert any("dist.barrier()" in s for s in silent) and any(".backward(" in s for s in silent), silent


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_same_sections_in_the_same_order(path):
    source = (REPO / path).read_text()
    found = re.findall(r"^# -{20,} (.+)$", source, flags=re.M)
    assert found == SECTIONS, found
    assert source.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')  # exit 75 after a stop signal
