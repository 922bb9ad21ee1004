"""Adjacent steps stay in line: every difference between a step and the one it builds on is part
of that step's lesson.

A step's lesson lines carry a marker comment naming it (`# DDP: ...`); lines that must differ but teach
nothing (a rank-0 guard, a launch option) carry `# plumbing: ...` instead. This test diffs adjacent
scripts statement by statement and accepts a changed block only if
  * a marker of the newer step, or a plumbing marker, sits in it or within a few lines of it, or
  * it is plumbing by its shape: the same statements as before with other arguments or assignment
    targets (a function that now also takes `scaler`, say), or imports, or
  * it removes the older step's own lesson lines (those with its marker).
It tells the two markers apart: the lesson must be most of what a diff marks.
Anything else (a changed learning rate, an evaluation fixed in one script only, a drifted
checkpoint call) fails with the offending lines, so the steps cannot silently drift apart.
It also checks that every script has the same sections, in the same order, and that each diff stays
within its budget of changed lines (`diff A B | grep -c '^[<>]'`, what a reader sees) and each script
within its length limit: the best tutorials' steps differ by 17-145 lines.
"""
import ast
import difflib
import re
import subprocess

import pytest

from helpers import REPO

# (base script, step script, marker of the step's lesson, most changed lines allowed between them)
PAIRS = [
    ("01_cifar10_cpu.py", "02_cifar10_gpu.py", "GPU:", 50),
    ("02_cifar10_gpu.py", "03_cifar10_dataparallel.py", "DataParallel:", 40),
    ("03_cifar10_dataparallel.py", "04_cifar10_ddp.py", "DDP:", 110),
    ("04_cifar10_ddp.py", "05_cifar10_deepspeed.py", "DeepSpeed:", 160),
    ("04_cifar10_ddp.py", "06_cifar10_horovod.py", "Horovod:", 115),
    ("04_cifar10_ddp.py", "07_cifar10_apex.py", "Apex:", 110),
    ("04_cifar10_ddp.py", "08_cifar10_fsdp.py", "FSDP:", 110),
]
PLUMBING = "plumbing:"
MARKERS = {step: marker for _, step, marker, _ in PAIRS}  # a script's own lesson marker
MAX_LINES, MAX_LINES_01 = 250, 165
SECTIONS = ["argument parsing", "process/device setup", "data", "model", "optimizer and schedule",
            "train one epoch", "evaluate", "checkpoint", "main"]
CONTEXT = 3  # logical lines around a block in which its marker may sit


def logical_lines(path):
    """The script after its docstring, as logical lines (a statement split over several lines is one)."""
    source = (REPO / path).read_text()
    tree = ast.parse(source)
    start = tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0
    lines, current, depth = [], [], 0
    for raw in source.splitlines()[start:]:
        code = raw.split("#", 1)[0] if not raw.lstrip().startswith(("'", '"', "f'", 'f"')) else raw
        current.append(raw.strip())
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            joined = " ".join(part for part in current if part)
            if joined:
                lines.append(joined)
            current, depth = [], 0
    return lines


def shape(line):
    """A statement with its strings blanked, argument lists emptied and assignment targets dropped."""
    code = re.sub(r"""f?(["'])(?:\\.|(?!\1).)*\1""", '""', line.split("  #", 1)[0].strip())
    previous = None
    while previous != code:
        previous, code = code, re.sub(r"\([^()]*\)", "<args>", code)
    return re.sub(r"^[\w\s,.\[\]]+=(?!=)\s*", "= ", code)


def not_plumbing(old, new):
    """The lines of a changed block that are more than imports or re-plumbed statements."""
    if all(line.startswith(("import ", "from ")) for line in old + new):
        return [], []
    old_shapes = [shape(line) for line in old]
    unmatched_new = []
    for line in new:
        if shape(line) in old_shapes:
            old_shapes.remove(shape(line))
        else:
            unmatched_new.append(line)
    unmatched_old = [line for line in old if shape(line) in old_shapes]
    return unmatched_old, unmatched_new


def unexplained_changes(base, step, marker):
    a, b = logical_lines(base), logical_lines(step)
    problems = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        removed, added = not_plumbing(a[i1:i2], b[j1:j2]) if tag != "equal" else ([], [])
        removed = [line for line in removed if f"# {MARKERS.get(base)}" not in line]  # the old method's own lines go
        if not removed and not added:
            continue
        nearby = b[max(0, j1 - CONTEXT):j2 + CONTEXT]
        if not any(marker in line or f"# {PLUMBING}" in line for line in nearby):
            problems.append(f"{base} -> {step}:\n  - " + "\n  - ".join(removed or ["(nothing)"])
                            + "\n  + " + "\n  + ".join(added or ["(nothing)"]))
    return problems


def present(pairs):
    return [pytest.param(*p, id=p[1][:2]) if (REPO / p[1]).exists() and (REPO / p[0]).exists()
            else pytest.param(*p, id=p[1][:2], marks=pytest.mark.skip(reason=f"{p[1]} not written yet"))
            for p in pairs]


@pytest.mark.parametrize("base,step,marker,budget", present(PAIRS))
def test_every_difference_is_the_lesson(base, step, marker, budget):
    problems = unexplained_changes(base, step, marker)
    assert not problems, (f"changes without a '# {marker}' marker nearby (drift, or a lesson line "
                          "missing its comment):\n" + "\n".join(problems))


def marked(path, marker):
    """The script's lines (as written) that carry `# marker`."""
    return [line for line in (REPO / path).read_text().splitlines() if f"# {marker}" in line]


@pytest.mark.parametrize("base,step,marker,budget", present(PAIRS))
def test_the_lesson_is_most_of_what_a_diff_marks(base, step, marker, budget):
    """Markers tell the lesson from plumbing; a diff whose plumbing outweighs its lesson has its mechanics in the
    wrong place (common/ is for them). No line is both."""
    lesson, plumbing = marked(step, marker), [line for line in marked(step, PLUMBING) if line not in marked(base, PLUMBING)]
    assert not [line for line in lesson if f"# {PLUMBING}" in line]
    print(f"{step}: {len(lesson)} lines marked '# {marker}', {len(plumbing)} new '# {PLUMBING}'")
    assert len(lesson) > 2 * len(plumbing), (lesson, plumbing)


def changed_lines(base, step):
    """What `diff base step | grep -c '^[<>]'` prints."""
    out = subprocess.run(["diff", base, step], cwd=REPO, stdout=subprocess.PIPE, text=True).stdout
    return sum(line.startswith(("<", ">")) for line in out.splitlines())


@pytest.mark.parametrize("base,step,marker,budget", present(PAIRS))
def test_every_diff_is_within_its_budget(base, step, marker, budget):
    count = changed_lines(base, step)
    assert count <= budget, f"{base} -> {step}: {count} changed lines, budget {budget}: move what is not the lesson"


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_every_script_is_within_its_length(path):
    limit = MAX_LINES_01 if path.startswith("01_") else MAX_LINES
    count = len((REPO / path).read_text().splitlines())
    assert count <= limit, f"{path}: {count} lines, limit {limit}"


def test_unmarked_drift_is_caught(tmp_path, monkeypatch):
    """The check itself can fail: an unmarked change of a hyper-parameter is reported."""
    drifted = (REPO / "02_cifar10_gpu.py").read_text().replace("WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1",
                                                               "WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 1e-4, 1")
    (tmp_path / "02_cifar10_gpu.py").write_text(drifted)
    (tmp_path / "01_cifar10_cpu.py").write_text((REPO / "01_cifar10_cpu.py").read_text())
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    problems = unexplained_changes("01_cifar10_cpu.py", "02_cifar10_gpu.py", "GPU:")
    assert len(problems) == 1 and "1e-4" in problems[0]


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_same_sections_in_the_same_order(path):
    source = (REPO / path).read_text()
    found = re.findall(r"^# -{20,} (.+)$", source, flags=re.M)
    assert found == SECTIONS, found
    assert source.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')  # exit 75 after a stop signal


def test_the_budget_check_can_fail():
    """01 -> 04 adds three lessons at once: far more changed lines than one step's budget."""
    assert changed_lines("01_cifar10_cpu.py", "04_cifar10_ddp.py") > 110
