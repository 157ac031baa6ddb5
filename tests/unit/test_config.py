import glob
import json
import os

import pytest

from deadpool_ext.config import ConfigError, DeadpoolConfig, split_deepspeed_config
from deadpool_ext.testing.launch import REPO


def test_defaults():
    cfg = DeadpoolConfig.from_dict({})
    assert cfg.enabled and cfg.snapshot.interval == 1 and cfg.replication.factor == 1
    assert cfg.local.shm_root == "/dev/shm" and cfg.snapshot.background


@pytest.mark.parametrize("section,key_path,allowed", [
    ({"snapshot": {"intervall": 2}}, "deadpool.snapshot.intervall", "interval"),
    ({"replication_factor": 1}, "deadpool.replication_factor", "replication"),
    ({"local": {"shm": "/x"}}, "deadpool.local.shm", "shm_root"),
])
def test_unknown_key_names_key_and_allowed(section, key_path, allowed):
    with pytest.raises(ConfigError) as err:
        DeadpoolConfig.from_dict(section)
    msg = str(err.value)
    assert key_path in msg and "unknown key" in msg and allowed in msg


@pytest.mark.parametrize("section,needle", [
    ({"snapshot": {"interval": 0}}, "deadpool.snapshot.interval: must be an integer >= 1"),
    ({"snapshot": {"interval": "1"}}, "deadpool.snapshot.interval: must be an integer"),
    ({"snapshot": {"interval": True}}, "deadpool.snapshot.interval: must be an integer"),
    ({"replication": {"factor": -1}}, "deadpool.replication.factor: must be an integer >= 0"),
    ({"log_level": "loud"}, "deadpool.log_level: must be one of debug, info, warning, error"),
    ({"job_id": "has space"}, "deadpool.job_id"),
    ({"enabled": "yes"}, "deadpool.enabled: must be true or false"),
    ({"local": {"simulate_nodes": -2}}, "deadpool.local.simulate_nodes"),
    ({"local": {"keep_after_exit_s": -1}}, "deadpool.local.keep_after_exit_s: must be a finite number of seconds >= 0"),
    ({"snapshot": {"derive_params": "no"}}, "deadpool.snapshot.derive_params: must be true or false"),
    ({"snapshot": 3}, "deadpool.snapshot: must be a JSON object"),
    ({"persist": {"when_busy": "block"}}, "deadpool.persist.when_busy: must be one of skip, wait"),
])
def test_bad_values(section, needle):
    with pytest.raises(ConfigError, match=None) as err:
        DeadpoolConfig.from_dict(section)
    assert needle in str(err.value)


def test_split_removes_section(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "deadpool": {"snapshot": {"interval": 3}}}))
    ds, dp = split_deepspeed_config(str(path))
    assert "deadpool" not in ds and ds["train_micro_batch_size_per_gpu"] == 1
    assert dp.snapshot.interval == 3
    ds, dp = split_deepspeed_config({"train_micro_batch_size_per_gpu": 1})
    assert dp is None


def test_shipped_configs_parse():
    paths = sorted(glob.glob(os.path.join(REPO, "configs", "*.json")))
    assert len(paths) >= 6
    for path in paths:
        ds, dp = split_deepspeed_config(path)
        assert dp is not None, f"{path} has no deadpool section"
        if "megatron" in os.path.basename(path):
            assert ds == {}, f"{path}: a Megatron --deadpool-config holds only the deadpool section"
            continue
        assert "zero_optimization" in ds


def test_differential_section_is_validated():
    cfg = DeadpoolConfig.from_dict({"differential": {"enabled": True, "base_interval": 5}})
    assert cfg.differential.base_interval == 5 and cfg.differential.compression == "none"
    with pytest.raises(ConfigError, match="deadpool.differential.base_interval: must be an integer >= 2"):
        DeadpoolConfig.from_dict({"differential": {"enabled": True, "base_interval": 1}})
    with pytest.raises(ConfigError, match="compression: must be one of none, bf16"):
        DeadpoolConfig.from_dict({"differential": {"compression": "int8"}})
    with pytest.raises(ConfigError, match="snapshot.interval must be 1"):
        DeadpoolConfig.from_dict({"differential": {"enabled": True}, "snapshot": {"interval": 2}})
