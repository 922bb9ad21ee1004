"""Run again the commands whose output the docs show, and write what they print into the pages.

    .venv/bin/python tests/docs_outputs.py          # every block of every page (about 5 minutes)
    .venv/bin/python tests/docs_outputs.py 04 05    # the blocks named output:04 and output:05
    .venv/bin/python tests/docs_outputs.py learning-table   # docs/results.md's (about 3 minutes)

A page marks each sample with <!-- output:NAME --> ... <!-- /output:NAME -->. Inside, every ```bash
fence is a run: its commands run in a shell from the repository root (the last one is the run shown;
the ones before prepare its data), and the plain ``` fence after it gets what that command printed
(its --out-dir under /tmp is removed first), less the launchers' and libraries' own lines (NOISE:
torchrun's OMP_NUM_THREADS notice, DeepSpeed's log, the profiler's). The block's text is updated
too, run by run in order: "Run on DATE on this repository's machine: ... torch VERSION", "load
average just before the run: X" and "N s wall, exit status R". Everything else in the block (what it
explains) is left for you to check against the new output: the script prints each block's old and
new output for that.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- output:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                   r"(<!-- /output:(?P=name) -->)", re.S)
RUN = re.compile(r"```bash\n(?P<commands>.*?)```\n(?P<between>.*?)```\n(?P<output>.*?)```\n", re.S)
NOISE = re.compile(r"OMP_NUM_THREADS|^\*{10,}|^W\d{4} |^\[W\d{4} |"
                   r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING)\]|"
                   r"^(STAGE:|USDT)|^\[rank\d+\]:\[W")


def machine():
    """The sentence's machine: the CPU,
    whether it computes bf16 natively (what --amp auto picks), and torch."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 "unknown CPU")
    probe = ("import torch; from common.cli import native_bf16; "
             "native, name = native_bf16(torch.device('cpu')); "
             "print(torch.__version__, native, name[len('this CPU ('):-1])")
    printed = subprocess.run([sys.executable, "-c", probe], cwd=REPO, text=True, check=True,
                             capture_output=True).stdout
    version, native, isa = printed.split(maxsplit=2)
    kind = "with" if native == "True" else "without"
    bf16 = f"{kind} native bf16 ({isa.strip()})"
    return f"a {os.cpu_count()}-core {model} {bf16}", version


def run(commands):
    """Run the fence's commands; return (the last command's kept output, seconds, exit status,
    load average)."""
    *prepare, shown = [line for line in commands.strip().splitlines() if line.strip()]
    # A fresh run each time (the pages write under /tmp).
    for folder in re.findall(r"--out-dir (/tmp/\S+)", shown):
        shutil.rmtree(folder, ignore_errors=True)
    for command in prepare:
        subprocess.run(command, shell=True, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    load = os.getloadavg()[0]
    began = time.monotonic()
    proc = subprocess.run(shown, shell=True, cwd=REPO, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    seconds = time.monotonic() - began
    kept = [line for line in proc.stdout.splitlines() if not NOISE.search(line)]
    return "\n".join(kept) + "\n", seconds, proc.returncode, load


def redo(body, today, cpu):
    """The block's body with every run's output and figures replaced by a new run's."""
    runs = []

    def one(match):
        output, seconds, status, load = run(match["commands"])
        runs.append((seconds, status, load))
        print(f"--- old\n{match['output']}--- new ({status}, {seconds:.0f} s)\n{output}")
        return f"```bash\n{match['commands']}```\n{match['between']}```\n{output}```\n"

    body = RUN.sub(one, body)
    figures = iter(runs)
    body = re.sub(r"load average just before the run: [\d.]+",
                  lambda m: f"load average just before the run: {next(figures)[2]:.2f}", body)
    figures = iter(runs)
    body = re.sub(r"(\d+) s wall, exit status (\d+)",
                  lambda m: "{:.0f} s wall, exit status {}".format(*next(figures)[:2]), body)
    body = re.sub(r"Exit status (\d+), (\d+) s wall",
                  lambda m: "Exit status {1}, {0:.0f} s wall".format(*runs[-1][:2]), body)
    described, version = cpu
    old = r"Run on \d{4}-\d\d-\d\d on this repository's machine: [^,]*, [^.]*?torch \d[\w.+]*\w"
    new = f"Run on {today} on this repository's machine: {described}, no GPU, torch {version}"
    return re.sub(old, new, body)


# docs/results.md's learning table: its rows, each one figure for the steps it names, run with the
# step pages' recipe (every step's command as its page shows it, the row's flags added).
RECIPE = "--data-dir /tmp/docs-data --arch cnn --workers 0 --epochs 2"
ONE, TWO = "--batch-size 64 --amp off", "--batch-size 32 --amp off"
TORCHRUN = ".venv/bin/torchrun --nproc_per_node=2"
DEEPSPEED = ("DS_ACCELERATOR=cpu .venv/bin/deepspeed -q --num_gpus {} 05_cifar10_deepspeed.py "
             "--deepspeed_config ds_config.json")
HOROVODRUN = ".venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python"
LEARNING = [
    ("01, 02, 03: 1 x 64, `--amp off`", "python",
     [f".venv/bin/python {s} {ONE}" for s in ("01_cifar10_cpu.py", "02_cifar10_gpu.py",
                                              "03_cifar10_dataparallel.py")]),
    ("04, 07, 08: 2 x 32, `--amp off`", "torchrun",
     [f"{TORCHRUN} {s} {TWO}" for s in ("04_cifar10_ddp.py", "07_cifar10_apex.py",
                                        "08_cifar10_fsdp.py")]),
    ("05: 2 x 32, `--amp off`, ds_config.json (ZeRO 2)", "deepspeed",
     [f"{DEEPSPEED.format(2)} {TWO}"]),
    ("06: 2 x 32, `--amp off`", "horovodrun", [f"{HOROVODRUN} 06_cifar10_horovod.py {TWO}"]),
    ("05: 1 x 64, `--zero-stage 0 --amp off`", "deepspeed",
     [f"{DEEPSPEED.format(1)} --zero-stage 0 {ONE}"]),
    ("04: 2 x 32, `--amp bf16`", "torchrun",
     [f"{TORCHRUN} 04_cifar10_ddp.py --batch-size 32 --amp bf16"]),
    ("05: 2 x 32, ds_config.json as it is (ZeRO 2, bf16)", "deepspeed",
     [f"{DEEPSPEED.format(2)} --batch-size 32 --amp bf16"]),
]


def learning_table():
    """docs/results.md's learning table from new runs (a row's steps must agree to the digit)."""
    subprocess.run(".venv/bin/python scripts/synthetic.py --data-dir /tmp/docs-data --train-size "
                   "3000 --test-size 500", shell=True, cwd=REPO, check=True)
    rows = ["| run | launcher | test accuracy, epoch 1 / 2 |", "|---|---|---|"]
    for number, (row, launcher, commands) in enumerate(LEARNING):
        found = set()
        for i, command in enumerate(commands):
            out = f"/tmp/docs-out/learning/{number}-{i}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(f"{command} {RECIPE} --out-dir {out}", shell=True, cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            lines = Path(out, "metrics.jsonl").read_text().splitlines()
            found.add(" / ".join(f"{100 * json.loads(line)['test_acc']:.1f}%" for line in lines))
        assert len(found) == 1, (row, found)
        rows.append(f"| {row} | {launcher} | {found.pop()} |")
        print(rows[-1])
    page = REPO / "docs" / "results.md"
    table = "<!-- learning-table -->\n" + "\n".join(rows) + "\n<!-- /learning-table -->"
    text = re.sub(r"<!-- learning-table -->.*?<!-- /learning-table -->", table,
                  page.read_text(), flags=re.S)
    page.write_text(text)


# The README's and results.md's TensorBoard screenshot: 01, 04 and 08 with the recipe above (1 x 64
# and 2 x 32, fp32), 4 epochs, every 2nd step's loss; a real TensorBoard server (its scalars page,
# the losses and accuracy, no smoothing), drawn by Debian's chromium (headless). `--loss-every 2`:
# more points on the step curve than the default 10.
SHOT = [(".venv/bin/python 01_cifar10_cpu.py", ONE), (f"{TORCHRUN} 04_cifar10_ddp.py", TWO),
        (f"{TORCHRUN} 08_cifar10_fsdp.py", TWO)]
CHROMIUM = ("chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
            "--disable-background-networking --disable-component-update --disable-sync "
            "--hide-scrollbars --window-size=1400,760 --virtual-time-budget=20000")


def tensorboard_screenshot():
    """docs/tensorboard.png from new runs, and the caption under each page's marker."""
    subprocess.run(".venv/bin/python scripts/synthetic.py --data-dir /tmp/docs-data --train-size "
                   "3000 --test-size 500", shell=True, cwd=REPO, check=True)
    runs = Path("/tmp/docs-out/tensorboard")
    shutil.rmtree(runs, ignore_errors=True)
    for command, batch in SHOT:
        name = re.search(r"(0\d_cifar10_\w+)\.py", command).group(1)
        subprocess.run(f"{command} {batch} {RECIPE} --epochs 4 --loss-every 2 --out-dir "
                       f"{runs / name}", shell=True, cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = subprocess.Popen([str(REPO / ".venv/bin/tensorboard"), "--logdir", str(runs),
                               "--host", "127.0.0.1", "--port", "6123"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(8)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(f"{CHROMIUM} --user-data-dir={profile} --screenshot="
                           f"{REPO / 'docs' / 'tensorboard.png'} "
                           "'http://127.0.0.1:6123/?darkMode=false#scalars&tagFilter=loss%7Cacc"
                           "&_smoothingWeight=0'", shell=True,
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        server.terminate()
    cpu, version = machine()
    caption = (f"01 (1 x 64), 04 and 08 (2 x 32) in TensorBoard: `--arch cnn --amp off`, 4 epochs, "
               f"`--loss-every 2`, run on {datetime.date.today().isoformat()} on this repository's "
               f"machine, {cpu}, torch {version} (`.venv/bin/python tests/docs_outputs.py "
               "tensorboard-screenshot`). 08 lies under 04: their runs end with the same bits.")
    # The README is a map: the picture, and where it was made.
    made = "How it was made: [results.md](docs/results.md#compare-runs-in-tensorboard)."
    for page, image, text in (("README.md", "docs/tensorboard.png", made),
                              ("docs/results.md", "tensorboard.png", caption)):
        path = REPO / page
        block = (f"<!-- tensorboard-screenshot -->\n![TensorBoard: 01, 04 and 08]({image})\n\n"
                 f"{text}\n<!-- /tensorboard-screenshot -->")
        text = re.sub(r"<!-- tensorboard-screenshot -->(.*?<!-- /tensorboard-screenshot -->)?",
                      block, path.read_text(), count=1, flags=re.S)
        path.write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="the blocks to redo (default: all), or "
                        "learning-table (docs/results.md's)")
    args = parser.parse_args()
    if args.names == ["learning-table"]:
        return learning_table()
    if args.names == ["tensorboard-screenshot"]:
        return tensorboard_screenshot()
    today, cpu = datetime.date.today().isoformat(), machine()

    def block(m):
        """A block with its body redone if it is one of the names asked for (all: none asked)."""
        asked = not args.names or m["name"] in args.names
        return m.group(1) + (redo(m["body"], today, cpu) if asked else m["body"]) + m.group(4)

    for page in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        text = page.read_text()
        new = BLOCK.sub(block, text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(REPO)}")


if __name__ == "__main__":
    main()
