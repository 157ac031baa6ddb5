"""A spare's engine relabelled for another data-parallel rank (issue 44, ``integrations/deepspeed/takeover.py``) has
exactly what DeepSpeed itself builds for that rank, in every attribute that depends on the rank: real engines,
each built solo in its own process (a spare's build), compared field by field. The end-to-end swap (a node the
spare did not build for killed, losses bit-identical) is test_hot_swap.py's."""
import json
import os
import subprocess
import sys

import pytest

from deadpool_ext.testing.launch import REPO, base_env
from tests.conftest import matrix

WORKER = os.path.join("tests", "integration", "workers", "relabel_fingerprint.py")


def _build(tmp_path, stage: int, rank: int, *targets: int) -> dict:
    out = tmp_path / f"s{stage}_r{rank}_{'_'.join(map(str, targets)) or 'built'}.json"
    res = subprocess.run([sys.executable, WORKER, str(stage), str(rank), str(out), *map(str, targets)], cwd=REPO,
                         env=base_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", matrix([0, 1, 2, 3], ci=[1]))
def test_an_engine_built_for_rank_1_relabelled_to_0_and_2_is_the_engine_built_for_each(tmp_path, stage):
    relabelled = _build(tmp_path, stage, 1, 0, 2)
    assert relabelled["refusal"] is None and relabelled["groups"] is None
    for target in (0, 2):
        built = _build(tmp_path, stage, target)["built"]
        got = relabelled[str(target)]
        diff = {k: (got.get(k), built.get(k)) for k in set(got) | set(built) if got.get(k) != built.get(k)}
        assert not diff, f"ZeRO-{stage}, rank 1 relabelled to {target}: {sorted(diff.items())[:10]}"
