"""slurm/*.sbatch on a real Slurm: a two-node cluster on this machine (scripts/slurm_cluster.sh:
Debian's slurmctld, two slurmd named n1 and n2, munge), jobs submitted with sbatch as a user would,
on the small generated data.

* 04 and 05 train across both nodes (each node's line in the log) and learn.
* A job warned of its time limit (`scancel --signal=USR1 --batch`, what
  `#SBATCH --signal=B:USR1@120` sends) checkpoints part-way, requeues itself, and the requeued run
  ends with the uninterrupted job's exact weights.

Skips (one line) only where Slurm cannot be installed: not root, or no apt-get.
"""
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, assert_trained, converted, digests, env, load_checkpoint

CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
# On the test nodes: no GPUs, one process per node (NPROC_PER_NODE for torchrun, one task per node
# for 05).
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
RUN = ["--amp", "off", "--epochs", "2", "--batch-size", "4"]  # 2 ranks x 4: 160 steps per epoch


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not all(shutil.which(tool) for tool in ("sbatch", "slurmctld", "slurmd", "munged")):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip("Slurm is not installed and cannot be here (needs root and apt-get): "
                        "sudo bash scripts/slurm_cluster.sh install")
        subprocess.run(["bash", CLUSTER, "install"], check=True, capture_output=True, timeout=600)
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    folder = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", CLUSTER, "start", folder], capture_output=True, text=True,
                             timeout=60)
    assert started.returncode == 0, started.stdout + started.stderr
    yield folder
    subprocess.run(["bash", CLUSTER, "stop", folder], capture_output=True, timeout=60)


def slurm(cluster, *command, check=True, timeout=60):
    """A Slurm command as a user types it, in the test cluster, with the venv's python/torchrun
    first on PATH."""
    proc = subprocess.run([str(c) for c in command], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout,
                          env=env(SLURM_CONF=cluster / "slurm.conf", NPROC_PER_NODE=1))
    assert not check or proc.returncode == 0, (
        f"{' '.join(map(str, command))}: {proc.stdout}{proc.stderr}")
    return proc


def submit(cluster, script, log, data, out, *sbatch_options, wait=True):
    """sbatch slurm/SCRIPT with the training options after it, as the scripts document; returns the
    job id."""
    proc = slurm(cluster, "sbatch", "--parsable", *(["--wait"] if wait else []), *CPU_JOB,
                 *sbatch_options, f"--output={log}", f"slurm/{script}", *data, *RUN,
                 "--out-dir", out, timeout=300)
    return proc.stdout.strip().split(";")[0]


def job_state(cluster, job):
    """{JobState, Restarts, Reason} of a job; {} once Slurm has forgotten it (MinJobAge after it
    ended)."""
    shown = slurm(cluster, "scontrol", "show", "job", job, check=False).stdout
    return dict(re.findall(r"\b(JobState|Restarts|Reason)=(\S+)", shown))


@pytest.fixture(scope="module")
def ddp_job(cluster, data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp_job")
    submit(cluster, "04_ddp.sbatch", folder / "job.out", data, folder / "out")
    return folder


@pytest.mark.parametrize("script", ["04_ddp.sbatch", "05_deepspeed.sbatch"])
def test_a_batch_script_trains_on_both_nodes(cluster, data, ddp_job, tmp_path, script):
    folder = ddp_job
    if script != "04_ddp.sbatch":  # 05: one task (rank) per node
        folder = tmp_path
        submit(cluster, script, folder / "job.out", data, folder / "out", "--ntasks-per-node=1")
    log = (folder / "job.out").read_text()
    assert "node n1 (node 0 of 2)" in log and "node n2 (node 1 of 2)" in log, log
    assert "on 2 x cpu" in log and "restart 0" in log, log
    if script != "04_ddp.sbatch":  # 05 writes its engine's folders: the last one made a .pt
        converted(folder / "out" / "ds_checkpoints" / "epoch0002", folder / "out")
    assert_trained(folder / "out", epochs=2, ranks=2)


def test_a_job_near_its_time_limit_checkpoints_requeues_and_ends_exactly(cluster, data, ddp_job,
                                                                         tmp_path):
    log, out = tmp_path / "job.out", tmp_path / "out"
    job = submit(cluster, "04_ddp.sbatch", log, data, out, wait=False)
    deadline = time.monotonic() + 120
    while "steps/epoch" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.1)
    # what --signal=B:USR1@120 sends at the time
    slurm(cluster, "scancel", "--signal=USR1", "--batch", job)
    # requeued, it may start again after 11 s (scripts/slurm_cluster.sh: cred_expire=10)
    while True:
        state, text = job_state(cluster, job), log.read_text()
        if state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1":
            break
        if not state and "epoch   2/2  train_loss" in text.partition("(restart 1)")[2]:
            break  # ended, and Slurm has already forgotten it (MinJobAge)
        assert time.monotonic() < deadline + 180, f"{state}\n{text}"
        time.sleep(0.5)
    text = log.read_text()
    assert ("time limit near: asking the job to checkpoint" in text
            and f"requeueing job {job}" in text), text
    stopped = re.search(r"stopped after step (\d+)/(\d+)", text)
    assert stopped, text
    assert (f"resumed from step {stopped.group(1)} of {stopped.group(2)}" in text
            and "restart 1" in text), text
    assert_trained(out, epochs=2, ranks=2)
    assert digests(out) == digests(ddp_job / "out"), (
        "the requeued job must end with the uninterrupted weights")
    assert load_checkpoint(out / "checkpoint-epoch0002.pt")["args"]["resume"] == "auto"
    assert not list(Path(out).glob("*-step*.pt"))


@pytest.mark.parametrize("visible,local_id,gpu", [(None, "3", "3"), ("0,1,2,3", "3", "3"),
                                                  ("2", "3", "0"), ("GPU-5a1c", "1", "0")])
def test_05_s_tasks_find_their_gpu_with_and_without_one_bound_to_each(visible, local_id, gpu):
    """Every GPU of the node visible to each task: LOCAL_RANK = the task's number on the node; one
    GPU bound to each task (--gpus-per-task=1, --gpu-bind, cgroups), so that it sees that one
    alone: 0. The sbatch's own line, in bash."""
    (line,) = [ln.strip()
               for ln in (REPO / "slurm" / "05_deepspeed.sbatch").read_text().splitlines()
               if ln.strip().startswith("GPU=")]
    task_env = {"SLURM_LOCALID": local_id,
                **({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {})}
    proc = subprocess.run(["bash", "-c", f'{line}\necho "$GPU"'], env=task_env, capture_output=True,
                          text=True)
    assert proc.stdout.strip() == gpu, proc
