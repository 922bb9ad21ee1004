"""The README's own commands, run as written, so that the README cannot drift from what works: the quick start's
set-up + main job line, and each step's launch command from the table of steps.

Flags appended to a command (argparse: the last one wins) only point it at small generated data and a temporary
--out-dir and make it short (--epochs 1, the small CNN, fp32); the table's 4 processes become 2 (2 cores here).
The launchers are the README's bare names (python, torchrun, deepspeed, horovodrun), found first on PATH in .venv.
"""
import re
import shlex

import pytest

from helpers import REPO, digests, metrics, run

README = (REPO / "README.md").read_text()
SHORT = ["--epochs", "1", "--arch", "cnn", "--workers", "0", "--amp", "off"]


def quick_start():
    """The commands of the README's first line of code: set up + main job, split at &&."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [command.strip() for command in block.splitlines()[0].split("#")[0].split("&&")]


def steps():
    """{step: its launch command} from the table of steps."""
    return dict(re.findall(r"^\| (0\d) \| .*? \| `([^`]+)` \| \[", README, re.M))


def shell(command, *appended, **kw):
    """Run a README command through bash from the repository root, with flags appended."""
    return run(["bash", "-c", " ".join([command, *map(shlex.quote, map(str, appended))])], **kw)


def test_the_quick_start_main_job_runs_as_written(tmp_path):
    setup, generate, train = quick_start()
    assert setup == "bash scripts/setup.sh"  # what .ci/run has done before the tests
    data = tmp_path / "synthetic"
    shell(generate, "--data-dir", data, "--train-size", "640", "--test-size", "101")
    proc = shell(train, "--data-dir", data, "--epochs", "1", "--out-dir", tmp_path / "out", timeout=300)
    assert "on 2 x cpu" in proc.output and "epoch   1/1" in proc.output, proc.output
    assert [row["epoch"] for row in metrics(tmp_path / "out")] == [1] and len(set(digests(tmp_path / "out").values())) == 1


def test_the_table_lists_every_step():
    assert sorted(steps()) == sorted(p.name[:2] for p in REPO.glob("0[1-9]_cifar10_*.py"))


@pytest.mark.parametrize("step", sorted(steps()))
def test_each_step_runs_with_its_readme_command(step, tmp_path, cifar_dir):
    command = re.sub(r"(nproc_per_node=|--num_gpus |-np |localhost:)4\b", r"\g<1>2", steps()[step])
    proc = shell(command, "--data-dir", cifar_dir, *SHORT, "--out-dir", tmp_path, timeout=300)
    ranks = 2 if command != steps()[step] else 1
    assert [row["epoch"] for row in metrics(tmp_path)] == [1], proc.output
    assert sorted(digests(tmp_path)) == list(range(ranks)) and len(set(digests(tmp_path).values())) == 1, proc.output
