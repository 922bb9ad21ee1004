"""Mutation check: does the suite catch a broken distributed step? Run on demand, not in the suite.

    .venv/bin/python tests/mutation_check.py              # every planted bug in 04-08 (about an
                                                          # hour on 2 cores)
    .venv/bin/python tests/mutation_check.py --step 08    # one step's
    .venv/bin/python tests/mutation_check.py --list       # what it plants, and the tests each
                                                          # step is held to

Each mutant is one plausible bug: a piece of a step's code (a regular expression that must match
exactly once) replaced by a broken version. For each, in a fresh copy of the repository with only
that change, the behavioural tests of its step run (pytest -x: the first failure is enough); the
verdict is CAUGHT (a test failed that passed on the step as it is), MISSED (every test passed),
UNSURE (only tests failed that did not pass without the mutant) or STALE (the piece is no longer in
the step: update the mutant). Before a step's mutants its tests run on the step as it is and must
pass (else its verdicts are UNSURE). Exit status 0 only when every mutant is caught. Run it before
and after a rewrite of the steps (docs/testing.md): a rewrite that keeps the behaviour keeps every
verdict, and a mutant that no longer applies says which one to update.
"""
import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


class Mutant(NamedTuple):
    step: int
    bug: str
    pattern: str  # a regular expression (re.M) that matches exactly once in the step
    broken: str  # what it becomes (re.sub's replacement)
    file: str = ""  # where the step's code is, if not in the step's script (e.g. common/)


# The tests each step is held to: every test of the suite that runs the step (its own file, its
# stops and resumes, its learning curve, its runs with the default model, its GPU paths rehearsed on
# the CPU).
CURVES = "tests/test_learning_curves.py::test_step_ends_bit_for_bit_where_its_reference_does"
DEFAULT = "tests/test_default_model.py::test_each_distributed_step_ends_exactly_where_ddp_does"
PREEMPT = "tests/test_preemption.py::test_a_stop_signal_saves_where_it_stopped_and_resumes_exactly"
GPU_PATHS = "tests/test_gpu_paths.py::test_"
TESTS = {
    4: ["tests/test_steps_01_04.py", f"{PREEMPT}[04-torchrun]",
        "tests/test_learning_curves.py::test_the_data_needs_two_epochs_at_either_shape[04-2x32]",
        "tests/test_default_model.py::test_04_learns_with_identical_replicas",
        "tests/test_06_horovod.py::test_06_and_04_continue_a_06_checkpoint_to_the_same_bits_and_01_trains_on",
        "tests/test_no_shared_disk.py::test_a_rank_without_the_checkpoint_resumes_what_rank_0_sends"
        "[04-ddp]"],
    5: ["tests/test_05_deepspeed.py", f"{PREEMPT}[05-deepspeed]", f"{CURVES}[5]",
        f"{DEFAULT}[05]",
        "tests/test_template.py::test_a_copy_of_05_trains_float_images_quietly_in_the_engines_precision",
        "tests/test_template.py::test_a_copy_of_05s_engine_checkpoint_of_2_processes_is_refused_by_1_"
        "with_the_way_that_works",
        "tests/test_template.py::test_a_copy_stopped_and_resumed_ends_where_an_uninterrupted_run_does"
        "[05-deepspeed]"],
    6: ["tests/test_06_horovod.py", f"{PREEMPT}[06-horovodrun]", f"{CURVES}[6]", f"{DEFAULT}[06]"],
    7: ["tests/test_07_apex.py", f"{PREEMPT}[07-torchrun]", f"{CURVES}[7]", f"{DEFAULT}[07]",
        "tests/test_no_shared_disk.py::test_a_rank_without_the_checkpoint_resumes_what_rank_0_sends"
        "[07-apex]",
        f"{GPU_PATHS}07_torch_path_with_fp16_skips_an_overflowing_step_and_its_scale_travels_in_the_"
        "checkpoint"],
    8: ["tests/test_08_fsdp.py", f"{PREEMPT}[08-torchrun]", f"{CURVES}[8]", f"{DEFAULT}[08]",
        f"{GPU_PATHS}08_policy_computes_in_bf16_with_batch_norm_in_fp32_on_the_cpu",
        f"{GPU_PATHS}08_fp16_policy_with_sharded_grad_scaler_skips_an_overflowing_step",
        f"{GPU_PATHS}08_units_are_runs_of_layers_computing_in_bf16_reducing_in_fp32_resharded_after_forward",
        "tests/test_data.py::test_every_distributed_step_evaluates_in_eval_batches",
        "tests/test_template.py::test_a_copy_stopped_and_resumed_ends_where_an_uninterrupted_run_does"
        "[08-fsdp]",
        "tests/test_checkpoint.py::test_08s_position_is_written_once_beside_its_shards_and_only_"
        "complete_folders_count"],
}

MUTANTS = [
    # 04: the five of the first check, and two more
    Mutant(4, "no set_epoch: every epoch the same order", r"sampler\.set_epoch\(epoch, ",
           "sampler.set_epoch(1, "),
    Mutant(4, "no shuffle", r"DistributedSampler\(train_set, shuffle=True",
           "DistributedSampler(train_set, shuffle=False"),
    Mutant(4, "evaluation without the all-reduce",
           r"^(\s+)dist\.all_reduce\(totals\)(.*\n\s+loss_sum)", r"\1totals = totals\2"),
    Mutant(4, "gradients never synced",
           r"contextlib\.nullcontext\(\) if last_pass else model\.no_sync\(\)", "model.no_sync()"),
    Mutant(4, "training in eval mode", r"^(\s+)model\.train\(\)", r"\1model.eval()"),
    Mutant(4, "batch-norm buffers not broadcast", r"DistributedDataParallel\(model, ",
           "DistributedDataParallel(model, broadcast_buffers=False, "),
    Mutant(4, "the schedule never steps", r"^(\s+)scheduler\.step\(\)", r"\1pass"),
    Mutant(4, "every rank reads the checkpoint from its own disk",
           r"checkpoint\.resume\(found\[0\], model,",
           "checkpoint.resume(checkpoint.find(args), model,"),
    Mutant(4, "the loss not divided by --grad-accum", r"scaler\.scale\(loss / args\.grad_accum\)",
           "scaler.scale(loss)"),
    # 05
    Mutant(5, "the loss divided by --grad-accum twice", r"^(\s+)engine\.backward\(loss\)",
           r"\1engine.backward(loss / args.grad_accum)"),
    Mutant(5, "batch-norm buffers not broadcast", r"^(\s+)dist\.broadcast\(buffer, 0\)", r"\1pass"),
    Mutant(5, "evaluation in train mode", r"^(\s+)engine\.eval\(\)", r"\1engine.train()"),
    Mutant(5, "an export continued at its raw step count",
           r"start_step = start_epoch \* steps_per_epoch \+ .*$", "start_step = global_step"),
    Mutant(5, "a part-way export's steps left out of the schedule",
           r" \+ sampler\.steps_done\(part_done\.get\(start_epoch \+ 1\)\)$", ""),
    Mutant(5, "the engine's checkpoint resumed without its optimizer state",
           r'engine\.load_checkpoint\(\*os\.path\.split\(state\["folder"\]\)\)',
           'engine.load_checkpoint(*os.path.split(state["folder"]), load_optimizer_states=False)'),
    Mutant(5, "--zero-stage ignored",
           r'^(\s+)config\.setdefault\("zero_optimization", \{\}\)\["stage"\] = '
           r"args\.zero_stage", r"\1pass"),
    Mutant(5, "evaluation without the all-reduce",
           r"^(\s+)dist\.all_reduce\(totals\)(.*\n\s+loss_sum)", r"\1totals = totals\2"),
    # 06
    Mutant(6, "--fp16-allreduce ignored",
           r"hvd\.Compression\.fp16 if args\.fp16_allreduce else hvd\.Compression\.none",
           "hvd.Compression.none"),
    Mutant(6, "momentum not broadcast on resume",
           r"^(\s+)hvd\.broadcast_optimizer_state\(optimizer, root_rank=0\)", r"\1pass"),
    Mutant(6, "the optimizer state broadcast after a checkpoint of weights only",
           r"^(\s+)if momentum:$", r"\1if global_step > 0:"),
    Mutant(6, "batch-norm buffers not broadcast",
           r"^(\s+)hvd\.broadcast_parameters\(dict\(model\.named_buffers\(\)\), "
           r"root_rank=0\)", r"\1pass"),
    Mutant(6, "every rank trains rank 0's shard", r"rank=hvd\.rank\(\), shuffle=True",
           "rank=0, shuffle=True"),
    Mutant(6, "training in eval mode", r"^(\s+)model\.train\(\)", r"\1model.eval()"),
    Mutant(6, "weights not broadcast on resume",
           r"^(\s+)hvd\.broadcast_parameters\(model\.state_dict\(\), "
           r"root_rank=0\)", r"\1pass"),
    Mutant(6, "the gradients averaged twice (divided by the processes once more)",
           r"scaler\.scale\(loss / args\.grad_accum\)",
           "scaler.scale(loss / args.grad_accum / hvd.size())"),
    Mutant(6, "a stop signal only at the end of an epoch",
           r"if last_pass and stop\.requested\(step // args\.grad_accum \+ 1\):", "if False:"),
    # 07
    Mutant(7, "GradScaler's update() dropped", r"^(\s+)scaler\.update\(\)", r"\1pass"),
    Mutant(7, "the optimizer steps around the scaler", r"^(\s+)scaler\.step\(optimizer\)",
           r"\1optimizer.step()"),
    Mutant(7, "a resumed run's loss scale not loaded", r"^(\s+)scaler\.load_state_dict\(saved\)",
           r"\1pass"),
    Mutant(7, "gradients never synced",
           r"contextlib\.nullcontext\(\) if last_pass else model\.no_sync\(\)", "model.no_sync()"),
    Mutant(7, "training in eval mode", r"^(\s+)model\.train\(\)", r"\1model.eval()"),
    Mutant(7, "the Apex path never broadcasts batch-norm buffers",
           r"for buffer in model\.module\.buffers\(\):", "for buffer in ():"),
    Mutant(7, "a stop signal only at the end of an epoch",
           r"if last_pass and stop\.requested\(step // args\.grad_accum \+ 1\):", "if False:"),
    # 08
    Mutant(8, "gradients reduced in the compute dtype (reduce_dtype dropped)",
           r"MixedPrecisionPolicy\(param_dtype=amp_dtype, reduce_dtype=torch\.float32\)",
           "MixedPrecisionPolicy(param_dtype=amp_dtype)"),
    Mutant(8, "gradients reduced in bf16",
           r"policy = MixedPrecisionPolicy\(param_dtype=amp_dtype, reduce_dtype=torch\.float32\)",
           "policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.bfloat16)"),
    Mutant(8, "every layer a unit of its own",
           r"if size\(runs\[-1\]\) \* UNITS >= size\(\[model\]\):", "if runs[-1]:"),
    Mutant(8, "units keep their whole weights after forward",
           r"fully_shard\(unit, mesh=mesh, mp_policy=policy\)",
           "fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=False)"),
    Mutant(8, "batch-norm buffers not broadcast", r"^(\s+)dist\.broadcast\(buffer, 0\)", r"\1pass"),
    Mutant(8, "--resume of a dcp/ folder not looked into for its newest",
           r"else own_folders\(path\) or newest or \[path\]\)\[0\]$", "else [path])[0]",
           "common/checkpoint.py"),
    Mutant(8, "--resume auto takes an unfinished save",
           r"if _kind\(path\) and os\.path\.isfile", "if os.path.isfile",
           "common/checkpoint.py"),
    Mutant(8, "gradients reduced on every accumulated pass",
           r"set_requires_gradient_sync\(last_pass\)", "set_requires_gradient_sync(True)"),
    Mutant(8, "a DCP resume without the optimizer state (momentum, learning rate)",
           r'set_state_dict\(model, optimizer, model_state_dict=shards\["model"\],\s+'
           r'optim_state_dict=shards\["optim"\]\)',
           'set_model_state_dict(model, shards["model"])'),
    Mutant(8, "a DCP resume without the loss scale",
           r"checkpoint\.resume\(state, load_model, load_optimizer, scheduler, scaler,",
           "checkpoint.resume(state, load_model, load_optimizer, scheduler, None,"),
    Mutant(8, "evaluation without the all-reduce",
           r"^(\s+)dist\.all_reduce\(totals\)(.*\n\s+loss_sum)", r"\1totals = totals\2"),
    Mutant(8, "each rank shards its own initial weights (no broadcast from rank 0)",
           r"^(\s+)dist\.broadcast\(tensor, 0\)", r"\1pass"),
    Mutant(8, "--replicate ignored: one row of all ranks",
           r"shape = \(args\.replicate, dist\.get_world_size\(\) // args\.replicate\)",
           "shape = (1, dist.get_world_size())"),
    Mutant(8, "one row kept a 2-D mesh (every unit all-reduces over one rank)",
           r'mesh = mesh if args\.replicate > 1 else mesh\["shard"\]', "mesh = mesh"),
    Mutant(8, "the last save never finished (its folder lacks .metadata)",
           r"^\s+if writing:\n\s+writing\.result\(\)\n(\s+log\.finish)", r"\1"),
    Mutant(8, "the DCP folder without the run's settings (a crashed run resumes with defaults)",
           r'"args": plain, ', '"args": {}, ', "common/checkpoint.py"),
]


def script(root, mutant):
    """The file the mutant changes: its step's script, or its own file."""
    if mutant.file:
        return Path(root) / mutant.file
    (path,) = Path(root).glob(f"{mutant.step:02d}_cifar10_*.py")
    return path


def applies(mutant, root=REPO):
    """Whether the mutant's pattern matches exactly once in its file (else it is STALE)."""
    return len(re.findall(mutant.pattern, script(root, mutant).read_text(), re.M)) == 1


def plant(mutant, root):
    """Apply the mutant to its file in `root`."""
    path = script(root, mutant)
    path.write_text(re.sub(mutant.pattern, mutant.broken, path.read_text(), count=1, flags=re.M))


def copy_repo(folder):
    """The tracked and untracked (not ignored) files of the repository, as they are in the working
    tree."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    return folder


def check(mutant, log_dir, tests, clean=None):
    """(verdict, seconds, log file, the tests that failed) of one mutant under `tests`.
    mutant.pattern None: the step as it is, which must pass; its passing tests are `clean` for the
    mutants after it, whose failure counts (CAUGHT) only in a test that passed without them."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        root = copy_repo(Path(tmp))
        if mutant.pattern is not None:
            plant(mutant, root)
        pytest = [PYTHON, "-m", "pytest", "-x", "-q", "-rA", "-p", "no:cacheprovider", *tests]
        proc = subprocess.run(pytest, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    slug = re.sub(r'[^a-z0-9]+', '-', mutant.bug.lower()).strip('-')
    log = log_dir / f"{mutant.step:02d}-{slug}.log"
    log.write_text(proc.stdout)
    outcomes = outcomes_of(proc.stdout)
    failed = sorted(test for test, outcome in outcomes.items() if outcome in ("FAILED", "ERROR"))
    summary = (proc.stdout.splitlines() or [""])[-1]
    # a skipped test (no Horovod, no Slurm) would hold nothing: every test must run
    if mutant.pattern is None:
        passed = proc.returncode == 0 and "skipped" not in summary
        verdict = "PASSED" if passed else f"FAILED ({summary.strip('= ')})"
        failed = sorted(test for test, outcome in outcomes.items() if outcome == "PASSED")
    elif proc.returncode == 0:
        verdict = "MISSED"
    elif not failed:
        verdict = f"ERROR (pytest exit {proc.returncode})"
    elif any(test in (clean or ()) for test in failed):
        verdict = "CAUGHT"
        failed = [test for test in failed if test in clean]
    else:
        # a test that fails without the mutant too says nothing of it
        verdict = "UNSURE"
    return verdict, time.monotonic() - started, log, failed


def outcomes_of(output):
    """{test id: PASSED, FAILED or ERROR} from pytest's -rA summary (-x under pytest-xdist ends a
    run with a failure as interrupted: the summary still names it)."""
    found = re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", output, re.M)
    return {test: outcome for outcome, test in found}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, action="append", choices=sorted(TESTS),
                        help="only this step's (repeatable)")
    parser.add_argument("--bug", action="append", metavar="TEXT",
                        help="only the mutants whose bug says TEXT")
    parser.add_argument("--test", action="append", metavar="TEXT",
                        help="only the step's tests whose name says TEXT: which of them catch a "
                             "bug")
    parser.add_argument("--list", action="store_true",
                        help="list the mutants and the tests, run nothing")
    parser.add_argument("--log-dir", default=REPO / "runs" / "mutation_check",
                        help="one pytest log per mutant")
    parser.add_argument("--docs", metavar="MD",
                        help="write the verdicts into this page (docs/testing.md)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if (not args.step or m.step in args.step)
              and (not args.bug or any(text in m.bug for text in args.bug))]
    if args.list:
        for step in sorted({m.step for m in chosen}):
            print(f"step {step:02d}, held to: {' '.join(TESTS[step])}")
            for mutant in (m for m in chosen if m.step == step):
                print(f"  {mutant.bug}")
        return 0
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    verdicts, started = [], time.monotonic()
    for step in sorted({m.step for m in chosen}):
        tests = [t for t in TESTS[step] if not args.test or any(text in t for text in args.test)]
        # First the step as it is: its tests must pass, or no failure below would say anything.
        as_is = Mutant(step, "none (the step as it is)", None, None)
        verdict, seconds, log, clean = check(as_is, log_dir, tests)
        print(f"{step:02d}  {verdict:<7} {seconds:6.0f} s  "
              f"none planted: the step as it is  ({log})", flush=True)
        for mutant in (m for m in chosen if m.step == step):
            if verdict != "PASSED":
                # the tests fail without a planted bug: fix that first
                result = ("UNSURE", 0.0, None, [])
            elif applies(mutant):
                result = check(mutant, log_dir, tests, clean)
            else:
                result = ("STALE", 0.0, None, [])
            verdicts.append((mutant, result[0]))
            where = f"  ({result[2]})" if result[2] else ""
            by = f"  caught by {result[3][0]}" if result[0] == "CAUGHT" else ""
            print(f"{step:02d}  {result[0]:<7} {result[1]:6.0f} s  {mutant.bug}{by}{where}",
                  flush=True)
    caught = sum(verdict == "CAUGHT" for _, verdict in verdicts)
    summary = f"{caught} of {len(verdicts)} planted bugs caught"
    print(summary + ("" if caught == len(verdicts)
                     else ": each one not CAUGHT above needs a harder test"))
    if args.docs:
        write_docs(Path(args.docs), verdicts, summary, time.monotonic() - started, argv)
    return 0 if caught == len(verdicts) else 1


def label(mutant):
    """A mutant's row in the docs' table up to its verdict: "| 04 | no shuffle"."""
    return f"| {mutant.step:02d} | {mutant.bug}"


def write_docs(page, verdicts, summary, seconds, argv):
    """The verdicts as a table between the page's mutation-verdicts marks: this run's rows replace
    those of the same bugs, the others stay as an earlier run left them (each row says when it was
    run)."""
    import torch

    start, end = "<!-- mutation-verdicts -->\n", "<!-- /mutation-verdicts -->"
    source = page.read_text()
    old = source[source.index(start) + len(start):source.index(end)]
    today = datetime.date.today()
    rows = {row.rsplit(" | ", 2)[0]: row for row in old.splitlines()
            if re.match(r"\| \d\d \|", row)}
    rows.update({label(m): f"{label(m)} | {verdict} | {today} |" for m, verdict in verdicts})
    # mutants that are gone: dropped
    rows = [rows.get(label(m), f"{label(m)} | not run | |") for m in MUTANTS]
    caught = sum(" | CAUGHT | " in row for row in rows)
    arguments = argv if argv is not None else sys.argv[1:]
    command = shlex.join(["python", "tests/mutation_check.py", *arguments])
    text = "\n".join([
        f"{caught} of {len(rows)} planted bugs caught. Latest run: {today}, `{command}`, on "
        f"{platform.processor() or platform.machine()} with {os.cpu_count()} cores, "
        f"torch {torch.__version__}: "
        f"{summary}, in {seconds / 60:.0f} minutes.", "",
        "| step | planted bug | verdict | run |", "|---|---|---|---|", *rows])
    head = source[:source.index(start) + len(start)]
    page.write_text(head + text + "\n" + source[source.index(end):])

if __name__ == "__main__":
    sys.exit(main())
