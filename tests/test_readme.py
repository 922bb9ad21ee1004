"""The README's own commands, run as written, so that the README cannot drift from what works: the
quick start's set-up + main job line, and each step's launch command from the table of steps.

Flags appended to a command (argparse: the last one wins) only point it at small generated data and
a --out-dir and make it short (the small CNN, fp32, 1 or 2 epochs); the table's 4 processes become 2
(2 cores here). The launchers are the README's bare names (python, torchrun, deepspeed, horovodrun),
found first on PATH in .venv. Most steps' commands start runs that other test files read
(conftest.py: run01, run04, run06, run08, and the learning-curve runs of 02, 03 and 07 on their 3000
images, 2 epochs each): a launch each, not two. 05's command reads its learning-curve run where this
session runs that anyway (the whole suite); alone (the quick tier, or this file) it gets a 1-epoch
launch of its own, cheaper than the learning-curve run.
"""
import re

import pytest

from helpers import README, REPO, digests, metrics, readme_command, shell

SHORT = ["--epochs", "1", "--arch", "cnn", "--workers", "0", "--amp", "off"]
SHARED = {1: "run01", 4: "run04", 6: "run06", 8: "run08"}  # conftest.py's fixtures
CURVES = {2, 3, 7}  # conftest.py's `curves`: the README command with the learning-curve recipe


def curve_made_anyway(number, session):
    """Whether this session runs a test that makes the learning-curve run of step `number`."""
    return any(item.path.stem == "test_learning_curves" and getattr(item, "callspec", None)
               and item.callspec.params.get("step") == number for item in session.items)


def quick_start():
    """The commands of the README's first line of code: set up + main job, split at &&."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [command.strip() for command in block.splitlines()[0].split("#")[0].split("&&")]


def steps():
    """The step numbers of the README's table of steps."""
    return [int(number)
            for number in re.findall(r"^\| (0\d) \| .*? \| `[^`]+` \| \[", README, re.M)]


def test_the_quick_start_main_job_runs_as_written(tmp_path):
    setup, generate, train = quick_start()
    assert setup == "bash scripts/setup.sh"  # what .ci/run has done before the tests
    data = tmp_path / "synthetic"
    shell(generate, "--data-dir", data, "--train-size", "640", "--test-size", "101")
    proc = shell(train, "--data-dir", data, "--epochs", "1", "--out-dir", tmp_path / "out",
                 timeout=300)
    assert "on 2 x cpu" in proc.output and "epoch   1/1" in proc.output, proc.output
    import torch

    from common.cli import amp_choice, native_bf16

    # --amp auto: what this CPU computes natively, and why (fp32 where bf16 would be emulated:
    # tests/test_steps_01_04.py)
    dtype, why = amp_choice("auto", torch.device("cpu"))
    assert (f"amp {'bf16' if native_bf16(torch.device('cpu'))[0] else 'off'} ({why}),"
            in proc.output), proc.output
    assert ([row["epoch"] for row in metrics(tmp_path / "out")] == [1]
            and len(set(digests(tmp_path / "out").values())) == 1)


def test_the_table_lists_every_step():
    assert sorted(steps()) == sorted(int(p.name[:2]) for p in REPO.glob("0[1-9]_cifar10_*.py"))


@pytest.mark.parametrize("number", steps(), ids=[f"{n:02d}" for n in steps()])
def test_each_step_runs_with_its_readme_command(number, tmp_path, cifar_dir, request):
    if number in SHARED:  # the fixture ran readme_command(number) with its own flags, 2 epochs
        found = request.getfixturevalue(SHARED[number])
        out = found[0] if isinstance(found, tuple) else found
    elif number in CURVES or curve_made_anyway(number, request.session):
        out = request.getfixturevalue("curves")(number)[0]
    else:
        out = tmp_path
        shell(readme_command(number), "--data-dir", cifar_dir, *SHORT, "--out-dir", out,
              timeout=300)
    epochs = 1 if out == tmp_path else 2
    ranks = 1 if readme_command(number).startswith("python ") else 2
    assert [row["epoch"] for row in metrics(out)] == list(range(1, epochs + 1)), metrics(out)
    assert (sorted(digests(out)) == list(range(ranks))
            and len(set(digests(out).values())) == 1), digests(out)


# A run's first line as the pages quote it: its batch arithmetic and the steps it makes of its data.
START = re.compile(r"batch (\d+) (?:per process x (\d+) processes x |x )(\d+) accumulation[^,]*, "
                   r"(\d+) training images, (\d+) steps/epoch")


def test_every_quoted_start_line_counts_the_steps_as_the_code_does():
    """A sample output written before the code changed what it prints is stale: every start line
    quoted in the README and docs/ must count its optimizer steps as the steps' own sampler
    (common/data.py's EpochSampler over a DistributedSampler) counts them for that arithmetic."""
    from torch.utils.data import DistributedSampler

    from common.data import EpochSampler

    quoted = [(page.name, match) for page in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
              for match in START.finditer(page.read_text())]
    assert len(quoted) >= 10, "the step pages quote their runs' first lines"
    for page, match in quoted:
        batch, processes, accumulation, images, steps = (int(g or 1) for g in match.groups())
        shard = DistributedSampler(range(images), num_replicas=processes, rank=0, shuffle=False)
        assert steps == EpochSampler(shard, batch * accumulation).steps, (page, match[0])
