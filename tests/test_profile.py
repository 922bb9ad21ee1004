"""--profile N, a flag of every step (common/cli.py, common/metrics.py Profile): a torch.profiler trace of N optimizer
steps on every rank, and a line per rank with the shares of compute, communication, data and other time. Checked on
the shared runs of 04 (DDP: gloo's all-reduce of the gradient buckets) and 08 (FSDP2: an all-gather per unit), which
trace 3 steps (conftest.py), and on 04 with one rank slowed from outside."""
import json
import re
from pathlib import Path

import pytest

from helpers import BIN, DDP_ARGS, free_port, run, script

LINE = (r"^profile rank {rank}: 3 steps, [\d.]+ ms each: compute (\d+)%, communication (\d+)%, data (\d+)%, other (\d+)% "
        r"\(trace: (.+)\)$")


@pytest.mark.parametrize("fixture,collective", [("run04", "gloo:all_reduce"), ("run08", "FSDP::all_gather")])
def test_every_rank_traces_its_steps_with_their_communication(fixture, collective, request):
    out, output = request.getfixturevalue(fixture)
    for rank in (0, 1):
        line = re.search(LINE.format(rank=rank), output, re.M)
        assert line, output
        shares = list(map(int, line.groups()[:4]))
        assert 98 <= sum(shares) <= 102 and shares[0] > 20, line.group(0)  # compute: the cnn's own operators
        assert Path(line.group(5)) == Path(out) / f"profile-rank{rank}.json"
        events = [event["name"] for event in json.loads(Path(line.group(5)).read_text())["traceEvents"]
                  if event.get("ph") == "X"]
        assert sum(name.startswith("Optimizer.step#") for name in events) == 3, "3 optimizer steps, no more"
        assert any(collective in name for name in events), sorted(set(events))


SLOW_RANK = '''"""Runs a step with rank 1 slowed from outside: every optimizer step of rank 1 first sleeps 0.1 s."""
import os, runpy, sys, time
import torch

if os.environ.get("RANK") == "1":
    step = torch.optim.SGD.step

    def slow_step(self, *args, **kwargs):
        time.sleep(0.1)
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = slow_step
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_a_rank_slowed_from_outside_shows_as_other_time_while_the_other_waits(tmp_path, data):
    """The slowed rank spends its sleep outside operators and collectives ("other"); the rank it holds up waits for
    it in a collective ("communication"). The wrapper only patches SGD.step on rank 1; 04 itself is unchanged. The
    trace asks for more steps than the epoch has: the epoch's end cuts it, and the line counts the steps it holds."""
    (tmp_path / "slow_rank.py").write_text(SLOW_RANK)
    output = run([BIN / "torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", tmp_path / "slow_rank.py",
                  script(4), *data, *DDP_ARGS, "--epochs", "1", "--profile", "100", "--out-dir", tmp_path / "out"]).output
    shares = {}
    for rank in (0, 1):  # 20 steps per epoch: the trace holds the 17 after the first 3, cut short by the epoch's end
        line = re.search(LINE.replace("3 steps", "17 steps").format(rank=rank), output, re.M)
        assert line, output
        shares[rank] = dict(zip(("compute", "communication", "data", "other"), map(int, line.groups()[:4])))
    assert shares[1]["other"] >= 15 and shares[0]["other"] < shares[1]["other"] / 2, shares
    assert shares[0]["communication"] >= 15 and shares[0]["communication"] > 1.5 * shares[1]["communication"], shares
