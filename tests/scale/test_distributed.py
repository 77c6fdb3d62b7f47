"""How a process decides to join a multi-host run, and the single-process behaviour of the helpers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from llds_jax.parallel.distributed import (
    DistributedSetupError,
    ProcessSetup,
    default_distributed_config,
    detect_setup,
    fetch_to_host,
    gather_over_hosts,
    global_batch_from_host_rows,
    host_batch_rows,
    initialize,
    sum_over_hosts,
)
from tests.scale import toy_train

pytestmark = pytest.mark.unit

ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}


def _config(**distributed):
    return ConfigDict({"distributed": {"coordinator_address": None, "num_processes": None,
                                       "process_id": None, **distributed}})


def test_config_fields_win_over_environment():
    setup = detect_setup(_config(coordinator_address="h0:1234", num_processes=2, process_id=1), ENV)
    assert setup == ProcessSetup("config", "h0:1234", 2, 1)


def test_default_section_means_unset():
    config = ConfigDict({"distributed": default_distributed_config()})
    assert detect_setup(config, {}) == ProcessSetup("single")
    config.distributed.auto_detect = True
    assert detect_setup(config, {}).source == "auto"
    config.distributed.update(auto_detect=False, coordinator_address="h:1", num_processes=2, process_id=0)
    assert detect_setup(config, {}) == ProcessSetup("config", "h:1", 2, 0)


def test_launch_script_environment_is_read():
    assert detect_setup(_config(), ENV) == ProcessSetup("env", "10.0.0.2:8476", 4, 3)


@pytest.mark.parametrize("environ, source", [
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}, "slurm"),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"}, "single"),
    ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "tpu_pod"),
    ({"LLDS_DISTRIBUTED": "auto"}, "auto"),
    ({"TPU_WORKER_HOSTNAMES": "w0"}, "single"),
    ({}, "single"),
])
def test_schedulers_are_detected(environ, source):
    assert detect_setup(None, environ).source == source


@pytest.mark.parametrize("config, environ, message", [
    (_config(coordinator_address="h0:1"), {}, r"not \['num_processes', 'process_id'\]"),
    (_config(coordinator_address="h0:1", num_processes=2, process_id=2), {}, "process_id=2 with num_processes=2"),
    (_config(coordinator_address="h0", num_processes=2, process_id=0), {}, "coordinator_address='h0'"),
    (_config(coordinator_address="h0:1", num_processes="two", process_id=0), {},
     "config.distributed.num_processes='two'"),
    (None, {"JAX_COORDINATOR_ADDRESS": "h:1"}, r"\['JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'\]"),
    (None, dict(ENV, JAX_PROCESS_ID="1.5"), "JAX_PROCESS_ID='1.5'"),
])
def test_inconsistent_settings_name_the_field(config, environ, message):
    with pytest.raises(DistributedSetupError, match=message):
        detect_setup(config, environ)


def test_single_process_needs_no_initialisation():
    assert initialize(None, {}) == ProcessSetup("single")
    assert not jax.distributed.is_initialized()


def test_single_host_owns_every_row_and_assembles_the_global_batch():
    mesh = toy_train.make_mesh((2, 4))
    sharding = NamedSharding(mesh, P(toy_train.MESH_AXES))
    rows = host_batch_rows(sharding, 64)
    assert rows == slice(0, 64)
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    global_x = global_batch_from_host_rows(x[rows], sharding, 64)
    assert global_x.sharding == sharding
    np.testing.assert_array_equal(fetch_to_host(global_x), x)
    with pytest.raises(ValueError, match="global batch 63"):
        host_batch_rows(sharding, 63)


def test_host_metrics_keep_float64_exactness():
    assert sum_over_hosts({"tokens": 2**40 + 1, "searches": 3}) == {"searches": 3.0, "tokens": 2.0**40 + 1}
    assert gather_over_hosts({"x": 1.5})["x"].shape == (1,)
