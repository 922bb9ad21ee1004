"""Adjacent steps stay in line, and a step's diff is its lesson.

A step marks its lesson one paragraph at a time: a comment line above the paragraph names the step
and says what it does (`# DDP: each rank trains on its own shard.`); it covers the statements below
it, down to the next blank line (or a line indented less than the comment). Lines that must differ
but teach nothing (a rank-0 guard, a launch option) are marked `# plumbing: ...` the same way. Every
call that all ranks must reach ends in `# collective`, and nothing else does. This test diffs
adjacent scripts statement by statement (a statement split over several lines is one) and
  * counts what a method's diff adds that is not its lesson: plumbing, unmarked statements
    (re-signed or moved code), the older step's marker on a new line; at most 15% of the statements
    it adds (imports aside),
  * fails an unmarked change that is more than plumbing by its shape (the same statement with other
    arguments or targets): a changed learning rate, an evaluation fixed in one script only,
  * keeps 01 -> 02 and 02 -> 03 as short as they are, every script within 300 lines (01: 180;
    05: 350, 07 and 08: 400), what a step adds besides its lesson within 40 lines, the same
    functions in the same order, and the names of common/ that a reader looks up to follow a step
    at 24 or fewer.
"""
import ast
import copy
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
# Changed lines of the first two diffs: as short as they were.
# 02: 40 since 01 moves inputs and labels on lines of their own (issue 61), as 02 does.
SHORT = {"02_cifar10_gpu.py": 40, "03_cifar10_dataparallel.py": 34}
NOT_LESSON = 0.15  # most of a method's added statements that may be something else than its lesson
PLUMBING = "plumbing:"
MARKERS = {step: marker for _, step, marker in PAIRS}  # a script's own lesson marker
# 01's lines; what a later step adds that is not its lesson (beyond its predecessor's lines); every
# step's lines (issue 60: what follows from narrow functions, public names, each method's own
# checkpoint format and comments that say why, not a goal of its own).
MAX_LINES_01, MAX_NOT_LESSON_ADDED, MAX_LINES = 180, 40, 300
STEP_LINES = {"05_cifar10_deepspeed.py": 350, "07_cifar10_apex.py": 400, "08_cifar10_fsdp.py": 400}
# 05 is over its 350 (2026-11-29, issue 60): its engine's config and schedule are functions of their
# own, it resumes both its engine folder and any step's .pt and checks that every rank sees the
# folder, and gathers fp32 weights at every ZeRO stage for the agreement after a resume. It writes
# the engine's checkpoint only (scripts/ds_to_pt.py makes the .pt): 399 lines before, 384 since. Its
# length today, so that it does not grow. 04, 05 and 07 are 2 over since their DataLoader workers
# start from a forkserver (a comment and data.workers_from_a_forkserver(): forking a rank with
# gloo's threads left a worker stuck, 2026-11-29); 06 had that already and 08 is within.
NOT_YET_WITHIN = {"04_cifar10_ddp.py": 302, "05_cifar10_deepspeed.py": 386,
                  "07_cifar10_apex.py": 402}
# ARCHS: resnet18, cnn, cnn_bn; cli.check_device; data.layout (any shape); checkpoint.find,
# position, agree and check_seen (a resume without a shared disk); checkpoint.own_path and
# save_position (05 and 08 name their folders as common/ finds them, issue 60);
# data.workers_from_a_forkserver (04-08, 2026-11-29)
MAX_NAMES = 25
# Lines in all of common/ (at 100 columns): 1,700 until 2026-11-29, when TensorBoard's writer and
# the per-step losses (issue 64, +70) and 08's position.json beside its DCP shards, written and
# found by the checkpoint format (issue 60, +52), came in; +20 the same day for the DataLoader
# workers' forkserver (data.workers_from_a_forkserver, a hang of a forked worker) and the one line
# for a data set that cannot travel to it pickled.
MAX_COMMON = 1820
# The functions of 01, in its order: every step has them, in that order (its own ones in between).
FUNCTIONS = ["parse_args", "setup", "build_data", "build_loaders", "build_model", "prepare_model",
             "build_optimizer", "train_one_epoch", "evaluate", "save_checkpoint", "resume", "main"]
# Calls where every rank must take part: each ends in `# collective`. From 04 on, a backward pass is
# one too (the gradients' all-reduce). fully_shard, a 1-D init_device_mesh and get_state_dict or
# set_state_dict of sharded state send nothing (counted with CommDebugMode; whole state dicts
# gather and scatter).
COLLECTIVES = re.compile(
    r"\bdist\.(all_reduce|broadcast\w*|barrier|new_group|all_gather\w*|monitored_barrier|"
    r"init_process_group)\(|\bdeepspeed\.(init_distributed|initialize)\(|"
    r"\bhvd\.(init|allreduce\w*|broadcast\w*|barrier|allgather\w*)\(|\bdcp\.(save|load)\(|"
    r"\bstop\.(requested|leave)\(|\.(save|load)_checkpoint\(|safe_get_full_fp32_param\(|"
    r"\b(get|set)_(model|optimizer)_state_dict\(|DistributedDataParallel\(|"
    r"\bdcp\.async_save\(|\boptimizer\.synchronize\(")
# Calls that may say `collective` too: a forward that communicates (DDP's buffers, ZeRO-3's and
# FSDP's gathers), an engine's step (ZeRO gathers the updated shards), a 2-D mesh (it makes groups),
# a resume that loads through the step's functions (08's gather and scatter whole states).
MAY_MEET = re.compile(r"\b(model|engine)\(inputs\)|\bengine\.step\(|\bcheckpoint\.resume\(|"
                      r"\binit_device_mesh\(|"
                      r"\boptimizer\.step\(|\bscaler\.step\(")
BACKWARD = re.compile(r"\.backward\(")


def statements(path):
    """The script after its docstring as (statement, its comments, the comments of the blocks it
    sits in, lines): a statement split over several lines is one; its comments are those on it, the
    comment block right above it and the marker of its paragraph; a block header other than a def
    (`if ...:` under a marker) marks the block it opens."""
    source = (REPO / path).read_text()
    tree = ast.parse(source)
    start = tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0
    found, current, depth, comments, headers = [], [], 0, [], []  # headers: (indent, their marks)
    paragraph = None  # (indent, text): the comment block that opened the current paragraph
    for raw in source.splitlines()[start:]:
        if not current and not raw.strip():
            paragraph = None
            continue
        if not current and raw.strip().startswith("#"):
            comments.append(raw.strip())
            continue
        if not current:
            indent = len(raw) - len(raw.lstrip())
            if comments:
                paragraph = (indent, " ".join(comments))
            elif paragraph and indent < paragraph[0]:
                paragraph = None
        code = raw.split("#", 1)[0] if not raw.lstrip().startswith(("'", '"', "f'", 'f"')) else raw
        current.append(raw.strip())
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0 and not code.rstrip().endswith("\\"):
            joined = " ".join(part for part in current if part)
            if joined:
                headers = [(level, text) for level, text in headers if level < indent]
                own = " ".join(comments) or (paragraph[1] if paragraph else "")
                outer = " ".join(text for _, text in headers)
                found.append((joined, own, outer, len(current) + len(comments)))
                if joined.split("  #")[0].rstrip().endswith(":") and not joined.startswith("def "):
                    headers.append((indent, f"{joined} {own} {outer}"))
            current, depth, comments = [], 0, []
    return found


def carries(statement, marker, own_only=False):
    """Whether a statement carries `# marker`: on it, in the comment right above it, or (not
    own_only) on a header of a block it sits in."""
    text, own, outer = statement[:3]
    tag = f"# {marker}"
    return tag in text or tag in own or (not own_only and tag in outer)


def shape(line):
    """A statement with its strings blanked, argument lists emptied and assignment targets dropped
    (`return x` is `= x`)."""
    code = re.sub(r"""f?(["'])(?:\\.|(?!\1).)*\1""", '""', line.split("  #", 1)[0].strip())
    code = re.sub(r"^return ", "= ", code)
    previous = None
    while previous != code:
        previous, code = code, re.sub(r"\([^()]*\)", "<args>", code)
    return re.sub(r"^[\w\s,.\[\]]+=(?!=)\s*", "= ", code)


def is_import(line):
    return line.startswith(("import ", "from "))


def added(base, step):
    """The statements (with their comments) that `step` adds or changes against `base`, and the
    statements of `base` they replace, as difflib's blocks: [(removed, added)]."""
    a, b = statements(base), statements(step)
    # A statement that only gains or loses its `# collective` label is the same code.
    keys = [[re.sub(r"  # collective\b.*$", "", s[0]) for s in found] for found in (a, b)]
    matcher = difflib.SequenceMatcher(None, *keys, autojunk=False)
    return [(a[i1:i2], b[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def unexplained_changes(base, step, marker):
    """Changed statements that carry no marker of the step and no plumbing marker, and are more than
    imports or re-plumbed statements (the same shapes as the ones they replace)."""
    problems = []
    for removed, new in added(base, step):
        old_shapes = [shape(s[0]) for s in removed]
        for statement in new:
            marked = carries(statement, marker) or carries(statement, PLUMBING)
            if marked or is_import(statement[0]):
                continue
            if shape(statement[0]) in old_shapes:
                old_shapes.remove(shape(statement[0]))
                continue
            problems.append(f"{base} -> {step}: + {statement[0]}")
    return problems


def not_the_lesson(base, step, marker):
    """(the statements `step` adds that are not its lesson, every statement it adds), imports
    aside."""
    new = [s for _, block in added(base, step) for s in block if not is_import(s[0])]
    return [s[0] for s in new if not carries(s, marker) or carries(s, PLUMBING, own_only=True)], new


def present(pairs):
    return [pytest.param(*p, id=p[1][:2]) for p in pairs]


@pytest.mark.parametrize("base,step,marker", present(PAIRS))
def test_every_difference_is_the_lesson(base, step, marker):
    problems = unexplained_changes(base, step, marker)
    assert not problems, (f"changes without a '# {marker}' marker on the statement or the comment "
                          "above it (drift, "
                          "or a lesson line missing its comment):\n" + "\n".join(problems))


@pytest.mark.parametrize("base,step,marker", present(PAIRS[2:]))
def test_what_is_not_the_lesson_is_at_most_15_percent_of_a_method_diff(base, step, marker):
    other, new = not_the_lesson(base, step, marker)
    print(f"{base} -> {step}: {len(new)} statements added, {len(other)} not marked '# {marker}'")
    assert len(other) <= NOT_LESSON * len(new), (
        f"{len(other)} of {len(new)} added statements are not the lesson (move them to common/ or "
        "the earliest step, or drop them):\n"
                                                 + "\n".join(other))


def changed_lines(base, step):
    """What `diff base step | grep -c '^[<>]'` prints."""
    out = subprocess.run(["diff", base, step], cwd=REPO, stdout=subprocess.PIPE, text=True).stdout
    return sum(line.startswith(("<", ">")) for line in out.splitlines())


@pytest.mark.parametrize("base,step,marker", present(PAIRS[:2]))
def test_the_first_diffs_stay_as_short_as_they_are(base, step, marker):
    assert changed_lines(base, step) <= SHORT[step], changed_lines(base, step)


def lines_not_the_lesson(path):
    """The script's lines, less those of the statements (and the comments above them) that it adds
    or changes against its predecessor and that carry its own marker, not plumbing's: a marker on
    code that is the predecessor's, or on a block header over it, does not make that code the
    lesson."""
    base = next((base for base, step, _ in PAIRS if step == path), None)
    new = [found for _, block in added(base, path) for found in block] if base else []
    lesson = sum(found[3] for found in new
                 if carries(found, MARKERS[path]) and not carries(found, PLUMBING, True))
    return len((REPO / path).read_text().splitlines()) - lesson


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_every_script_is_within_its_length(path):
    """Every line of 01; of a later step, what is not its lesson: the predecessor's code, plumbing,
    its docstring."""
    base = next((base for base, step, _ in PAIRS if step == path), None)
    limit = MAX_LINES_01
    if base:
        limit = len((REPO / base).read_text().splitlines()) + MAX_NOT_LESSON_ADDED
    count = lines_not_the_lesson(path)
    assert count <= limit, (f"{path}: {count} lines that are not its lesson, limit {limit} (move "
                            "plumbing to common/)")
    lines = len((REPO / path).read_text().splitlines())
    most = NOT_YET_WITHIN.get(path, STEP_LINES.get(path, MAX_LINES))
    assert lines <= most, f"{path}: {lines} lines, at most {most}"


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[4-9]_cifar10_*.py")))
def test_every_collective_says_so_and_nothing_else_does(path):
    """Every call where the ranks meet ends in `# collective`: a reader who edits the loop sees
    every place where one rank skipping a call would leave the others waiting. A call that sends
    nothing does not say it (the label would teach the wrong thing)."""
    silent, wrong = silent_collectives(path), false_collectives(path)
    assert not silent, "collectives without `# collective`:\n" + "\n".join(silent)
    assert not wrong, "`# collective` on calls that send nothing:\n" + "\n".join(wrong)


def code_of(statement):
    return statement.split("  #")[0]


def labelled(statement):
    return re.search(r"  # collective\b", statement) is not None


class _WithoutInnerFunctions(ast.NodeTransformer):
    def visit_FunctionDef(self, node):
        return None

    def visit_Lambda(self, node):
        return ast.Constant(None)


def own_calls(node):
    """The code of a function's own body, less the functions defined inside it (a closure that a
    library calls later, such as stop_agreement's)."""
    body = [_WithoutInnerFunctions().visit(child) for child in copy.deepcopy(node.body)]
    return "\n".join(ast.unparse(child) for child in body if child is not None)


def meeting_functions(path):
    """The script's own functions whose bodies meet the other ranks: a collective, or a call of
    another such function (main aside: the process runs it)."""
    tree = ast.parse((REPO / path).read_text())
    bodies = {node.name: own_calls(node) for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name != "main"}
    meeting = {name for name, body in bodies.items() if COLLECTIVES.search(body)}
    while True:
        calls = calls_of(meeting)
        more = {name for name, body in bodies.items() if calls and calls.search(body)} - meeting
        if not more:
            return meeting
        meeting |= more


def calls_of(functions):
    """A pattern for a call of one of `functions` (not its def), or None."""
    if functions:
        return re.compile(rf"(?<!def )(?<![\w.])({'|'.join(sorted(functions))})\(")
    return None


def silent_collectives(path):
    """Statements that meet the other ranks without `# collective`: a collective, a backward, or a
    call of the step's own function that meets them."""
    calls_own = calls_of(meeting_functions(path))
    return [s for s, *_ in statements(path)
            if (COLLECTIVES.search(code_of(s)) or BACKWARD.search(code_of(s))
                or (calls_own and calls_own.search(code_of(s)))) and not labelled(s)]


def false_collectives(path):
    calls_own = calls_of(meeting_functions(path))
    return [s for s, *_ in statements(path) if labelled(s) and not (
        COLLECTIVES.search(code_of(s)) or BACKWARD.search(code_of(s)) or MAY_MEET.search(code_of(s))
        or (calls_own and calls_own.search(code_of(s))))]


def common_names(path):
    """The names of common/ a reader looks up to follow `path`: module.attribute references and
    names imported."""
    tree = ast.parse((REPO / path).read_text())
    modules, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common"):
            if node.module == "common":
                modules |= {alias.asname or alias.name for alias in node.names}
            else:
                names |= {alias.asname or alias.name for alias in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            names.add(f"{node.value.id}.{node.attr}")
    return names


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_a_reader_looks_up_at_most_24_names_of_common(path):
    names = common_names(path)
    print(f"{path}: {len(names)} names of common/: {sorted(names)}")
    assert len(names) <= MAX_NAMES, sorted(names)


# What would make common/ do a method's work: importing a parallelism library, or meeting the other
# ranks (issue 38's grep, and any use of torch.distributed).
METHOD_OR_COLLECTIVE = re.compile(r"import deepspeed|horovod|apex|distributed.checkpoint|fsdp|"
                                  r"all_reduce|broadcast|"
                                  r"barrier|new_group|all_gather|torch\.distributed|\bdist\.")


def test_common_is_small_and_does_no_method_work():
    """common/ reads the data, builds the models, writes the checkpoint format, the schedule, the
    command line and the log: at most MAX_COMMON lines, no parallelism library, no torch.distributed
    (so no collective); its comments, docstrings and messages may name them."""
    import io
    import tokenize

    files = sorted((REPO / "common").glob("*.py"))
    total = sum(len(path.read_text().splitlines()) for path in files)
    assert total <= MAX_COMMON, f"common/ has {total} lines, at most {MAX_COMMON}"
    found = []
    for path in files:
        source = path.read_text()
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            # Comments, docstrings and messages may name a library or a step's file.
            if token.type in (tokenize.COMMENT, tokenize.STRING):
                continue
            if METHOD_OR_COLLECTIVE.search(token.string):
                found.append(f"{path.name}:{token.start[0]}: {token.line.strip()}")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [alias.name for alias in node.names] + [getattr(node, "module", "")]
                if any(m.split(".")[0] in ("deepspeed", "horovod", "apex")
                       or m.startswith("torch.distributed") for m in modules if m):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_common_check_finds_a_collective(tmp_path, monkeypatch):
    """The check above is not blind: a collective in a copy of common/ fails it."""
    import shutil

    shutil.copytree(REPO / "common", tmp_path / "common")
    metrics = tmp_path / "common" / "metrics.py"
    collective = "COLLECTIVE = torch.distributed.all_reduce  # a collective"
    metrics.write_text(re.sub(r"COLLECTIVE = .*", collective,
                              metrics.read_text()))
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    with pytest.raises(AssertionError, match="metrics.py:.*all_reduce"):
        test_common_is_small_and_does_no_method_work()


def test_unmarked_drift_is_caught(tmp_path, monkeypatch):
    """The check itself can fail: an unmarked change of a hyper-parameter is reported."""
    drifted = (REPO / "02_cifar10_gpu.py").read_text().replace(
        "WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 5e-4, 1", "WEIGHT_DECAY, WARMUP_EPOCHS = 0.9, 1e-4, 1")
    (tmp_path / "02_cifar10_gpu.py").write_text(drifted)
    (tmp_path / "01_cifar10_cpu.py").write_text((REPO / "01_cifar10_cpu.py").read_text())
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    problems = unexplained_changes("01_cifar10_cpu.py", "02_cifar10_gpu.py", "GPU:")
    assert len(problems) == 1 and "1e-4" in problems[0]


def test_a_lesson_line_without_its_marker_counts_against_the_diff(tmp_path, monkeypatch):
    """The budget can fail: 04's markers stripped, its diff is mostly not the lesson and every line
    counts against its length; a collective stripped of its marker is named; markers on block
    headers do not shorten the count."""
    source = (REPO / "04_cifar10_ddp.py").read_text()
    honest = lines_not_the_lesson("04_cifar10_ddp.py")
    (tmp_path / "04_cifar10_ddp.py").write_text(re.sub(r"# DDP:", "# note:", source))
    base = (REPO / "03_cifar10_dataparallel.py").read_text()
    (tmp_path / "03_cifar10_dataparallel.py").write_text(base)
    monkeypatch.setattr("test_steps_in_line.REPO", tmp_path)
    other, new = not_the_lesson("03_cifar10_dataparallel.py", "04_cifar10_ddp.py", "DDP:")
    assert len(other) == len(new) > 20
    # The length counts every line then.
    assert lines_not_the_lesson("04_cifar10_ddp.py") == len(source.splitlines())
    # A marker on block headers over 03's own code does not make that code 04's lesson: only the
    # headers themselves.
    marked, headers = re.subn(r"^(\s*for .*:)$", r"\1  # DDP: loop", source, flags=re.M)
    (tmp_path / "04_cifar10_ddp.py").write_text(marked)
    assert headers and honest - headers <= lines_not_the_lesson("04_cifar10_ddp.py") < honest
    (tmp_path / "04_cifar10_ddp.py").write_text(source.replace("# collective", "# meeting"))
    silent = silent_collectives("04_cifar10_ddp.py")
    assert any("dist.barrier()" in s for s in silent), silent
    assert any(".backward(" in s for s in silent), silent
    # So is a call of the step's own function that meets the other ranks.
    (tmp_path / "04_cifar10_ddp.py").write_text(
        source.replace("resume(args, training)  # collective", "resume(args, training)"))
    assert any("= resume(args, training)" in s for s in silent_collectives("04_cifar10_ddp.py"))
    # A label on a call that sends nothing is named too.
    labelled = re.sub(r"^(\s+model\.train\(\))$", r"\1  # collective", source, flags=re.M)
    (tmp_path / "04_cifar10_ddp.py").write_text(labelled)
    assert [s for s in false_collectives("04_cifar10_ddp.py") if "model.train()" in s]


@pytest.mark.parametrize("path", sorted(p.name for p in REPO.glob("0[1-9]_cifar10_*.py")))
def test_the_same_functions_in_the_same_order(path):
    source = (REPO / path).read_text()
    defined = [node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)]
    assert [name for name in defined if name in FUNCTIONS] == FUNCTIONS, defined
    # main()'s status is the exit status: 75 after a stop signal.
    assert source.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')
