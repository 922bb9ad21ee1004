"""--profile N, a flag of every step (common/cli.py, common/metrics.py Profile): a torch.profiler trace of N optimizer
steps on every rank, and a line per rank with the shares of compute, communication, data and other time. Checked on
the shared runs of 04 (DDP: gloo's all-reduce of the gradient buckets) and 08 (FSDP2: an all-gather per unit), which
trace 3 steps (conftest.py). The recipes that use it, on runs with a fault injected: tests/test_debugging.py."""
import json
import re
from pathlib import Path

import pytest

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
