"""The step-time model's training collectives, counted by hand: which phase pays which gather, at which link.

What the counts rest on (a gather a micro-batch of a no-grad pass, two and a reduce-scatter an update) is
checked against XLA:GPU's compiled programs in ``tests/scale/test_plan_collectives.py``.
"""

import pytest

from llds_jax.config import base_config
from llds_jax.data.lengths import TrajectoryLengths
from llds_jax.models.testing import tiny_config
from llds_jax.plan.collectives import GPU_NETWORK, collective_seconds, micro_batch_traffic
from llds_jax.plan.retrieval import INTERCONNECT
from llds_jax.plan.step_time import predict_step_time
from llds_jax.utils import flops

pytestmark = pytest.mark.unit

CFG = tiny_config("qwen2", dtype="bfloat16")


def _config(mesh=(1, -1, 1)):
    config = base_config()
    config.mesh.shape = mesh
    config.train.micro_batch_size, config.train.logprob_batch_size = 16, 32
    return config


def _seconds(config=None, *, platform="gpu", hardware="H100", devices=8, hosts=1, delta_every=1, compute=None):
    return collective_seconds(config or _config(), CFG, platform=platform, hardware=hardware, devices=devices,
                              hosts=hosts, compute_bytes=2, train_rows=64, packing=None, passes=2,
                              delta_every=delta_every, compute_seconds=compute)


def test_each_training_phase_pays_its_micro_batches_gathers_at_the_chips_link():
    seconds, why = _seconds()
    traffic, link = micro_batch_traffic(CFG, (1, 8, 1), 2), INTERCONNECT["H100"][0]
    assert traffic.layers_gather == CFG.num_layers * flops.layer_weights(CFG) * 2 * 7 / 8
    assert traffic.embedding_gather == CFG.vocab_size * CFG.hidden_size * 2 * 7 / 8
    assert traffic.embedding_fp32 == 2 * traffic.embedding_gather  # fp32
    assert traffic.all_reduce == 0  # no data axis: nothing to sum across replicas
    # 64 padded rows: 2 log-prob micro-batches of 32 a pass (π_old, π_ref), the table gathered once a pass;
    # 4 update micro-batches of 16, each gathering the layers twice and the table's 3 fp32 passes
    no_grad = traffic.embedding_gather + 2 * traffic.layers_gather
    assert seconds["logprobs"] == pytest.approx(2 * no_grad / link)
    assert seconds["update"] == pytest.approx(
        4 * (2 * traffic.layers_gather + traffic.layers_reduce_scatter + 3 * traffic.embedding_fp32) / link)
    assert seconds["delta"] == pytest.approx(no_grad / link)
    assert "none overlapped" in why and "450 GB/s" in why
    assert _seconds(delta_every=4)[0]["delta"] == pytest.approx(seconds["delta"] / 4)


def test_on_a_gpu_the_pipelined_collectives_cost_only_what_they_outlast_a_layer_trip_by():
    traffic, link = micro_batch_traffic(CFG, (1, 8, 1), 2), INTERCONNECT["H100"][0]
    layers = CFG.num_layers
    gather, scatter = traffic.layers_gather / layers / link, traffic.layers_reduce_scatter / layers / link
    ample = {"forward": 1.0, "update_forward": 1.0, "update_backward": 2.0}  # seconds a pass: every trip outlasts
    hidden, why = _seconds(compute=ample)
    # 2 passes of 2 log-prob micro-batches: the table's gather once a pass and the first layer's (peeled)
    # each micro-batch exposed
    assert hidden["logprobs"] == pytest.approx(2 * (traffic.embedding_gather / link + 2 * gather))
    assert hidden["delta"] == pytest.approx(hidden["logprobs"] / 2)
    # 4 update micro-batches: the first layer's gather, the backward's layer gathers whole, the last layer's
    # reduce-scatter, the table's fp32 passes
    exposed = gather + layers * gather + scatter + 3 * traffic.embedding_fp32 / link
    assert hidden["update"] == pytest.approx(4 * exposed) and "pipelined" in why
    # with no compute to run behind, a pipelined collective costs what it did unpipelined
    starved, _ = _seconds(compute={"forward": 0.0, "update_forward": 0.0, "update_backward": 0.0})
    assert starved == pytest.approx(_seconds()[0])
    # a trip shorter than its collective: the excess of every trip but the peeled one
    short = {"forward": 2 * layers * gather / 2, "update_forward": 1.0, "update_backward": 2.0}  # half a gather a trip
    assert _seconds(compute=short)[0]["logprobs"] == pytest.approx(
        hidden["logprobs"] + 2 * 2 * (layers - 1) * gather / 2)
    # XLA:TPU's schedule is not read: everything stays charged there
    tpu, why = _seconds(platform="tpu", hardware="v5e", compute=ample)
    assert tpu == pytest.approx(_seconds(platform="tpu", hardware="v5e")[0]) and "not read" in why


def test_hosts_of_gpus_gather_over_their_network_and_cpus_or_one_device_pay_nothing():
    one_host, _ = _seconds()
    two_hosts, why = _seconds(hosts=2)
    ratio = INTERCONNECT["H100"][0] / GPU_NETWORK[0]
    assert two_hosts["update"] == pytest.approx(one_host["update"] * ratio) and "InfiniBand" in why
    assert _seconds(platform="cpu", hardware="")[0] == {"logprobs": 0.0, "update": 0.0, "delta": 0.0}
    nothing, why = _seconds(devices=1)
    assert set(nothing.values()) == {0.0} and "shards no weight" in why


def test_replicas_over_data_sum_their_gradients_and_gather_nothing():
    config = _config(mesh=(-1, 1, 1))
    seconds, _ = _seconds(config)
    traffic = micro_batch_traffic(CFG, (8, 1, 1), 2)
    assert (traffic.layers_gather, traffic.embedding_gather, traffic.layers_reduce_scatter,
            traffic.embedding_fp32) == (0, 0, 0, 0)
    assert traffic.all_reduce > 0
    assert seconds["logprobs"] == 0 and seconds["update"] == pytest.approx(4 * traffic.all_reduce / INTERCONNECT["H100"][0])


def test_the_step_time_adds_them_to_the_training_phases():
    config = _config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    lengths = [TrajectoryLengths(10, (5, 2), (4,)), TrajectoryLengths(10, (3, 6), (4,))]

    def step(hardware):
        return predict_step_time(config, CFG, platform="gpu", peak=flops.Peak(1e12, 1e11, "test"), devices=8,
                                 hosts=1, rows_per_wave=4, train_rows=64, train_length=64, scored_per_row=16,
                                 state_bytes=8e9, lengths=lengths, hardware=hardware)

    linked, unlinked = step("H100"), step("")
    paid = linked.details["collective_seconds"]
    assert unlinked.details["collective_seconds"] == {"logprobs": 0.0, "update": 0.0, "delta": 0.0}
    for phase in ("logprobs", "update", "delta"):
        assert paid[phase] > 0
        assert linked.seconds[phase] == pytest.approx(unlinked.seconds[phase] + paid[phase])
    assert "collectives" in linked.assumptions
