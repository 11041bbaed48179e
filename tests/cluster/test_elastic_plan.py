"""How an elastic job (`cluster.elastic`) chooses its slices and reshapes its config for them."""

import pytest

from podtrain.orchestrator.cluster import elastic
from podtrain.orchestrator.cluster.elastic import Elastic, resized
from podtrain.orchestrator.cluster.reserve import ReservationError
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config

TPU = ["cluster=tpu", "cluster.tpu_type=v4-16", "cluster.elastic=true", "mesh.fsdp=1", "mesh.tp=4"]


def config(slices, *extra):
    return load_config("llama3-tiny", [*TPU, f"cluster.num_slices={slices}", f"mesh.dp={slices}", *extra])


def test_fewer_slices_keep_the_global_batch_with_more_accumulation_or_say_why_they_cannot():
    two = config(2, "train.batch_size=8", "train.grad_accum=1")
    one = resized(two, 1)
    assert (one.cluster.num_slices, one.mesh.dp, one.train.grad_accum, one.train.batch_size) == (1, 1, 2, 8)
    assert resized(two, 2) is two
    three = config(3, "train.batch_size=6", "train.grad_accum=1")
    assert resized(three, 2) == ("train.batch_size=6 with train.grad_accum=1 cannot be split over 2 of cluster."
                                 "num_slices=3 slices: gradient accumulation would have to be 3/2 micro-batches")
    assert resized(three, 1).train.grad_accum == 3


def test_elastic_needs_several_tpu_slices():
    with pytest.raises(ConfigError, match=r"cluster.elastic: expected cluster.kind=tpu with cluster.num_slices > 1, "
                                          r"found cluster.kind=local with cluster.num_slices=1"):
        load_config("llama3-tiny", ["cluster.elastic=true"])
    with pytest.raises(ConfigError, match=r"cluster.min_slices: expected 1 to cluster.num_slices=2, found 3"):
        config(2, "cluster.min_slices=3")


class Gang:
    def __init__(self, hosts):
        self.actors = [None] * hosts


def test_a_lost_slice_is_waited_for_then_the_job_goes_on_with_the_rest_and_grows_back(monkeypatch):
    job = config(2, "train.batch_size=8", "cluster.elastic_wait_s=7", "cluster.reserve_timeout_s=60")
    e, said, asked, free, releasing = Elastic.of(job.cluster, service=False), [], [], [2], [0]
    monkeypatch.setattr(elastic, "free_slices", lambda cluster, hosts: free[0])
    monkeypatch.setattr(elastic, "whole_slices", lambda cluster, hosts: free[0])

    def reserve(cluster, name):  # a reservation waits for a slice being released
        asked.append((cluster.num_slices, cluster.reserve_timeout_s))
        if cluster.num_slices > free[0] + releasing[0]:
            raise ReservationError("no slice")
        return Gang(2 * cluster.num_slices)

    gang, first = e.reserve(job, "a1", reserve, said.append)
    assert first is job and asked == [(2, 60)] and e.hosts_per_slice == 2
    e.lost, free[0] = True, 1  # a slice is gone
    gang, shrunk = e.reserve(job, "a2", reserve, said.append)
    assert asked[1:] == [(2, 7), (1, 60)] and (shrunk.mesh.dp, shrunk.train.grad_accum) == (1, 2)
    assert said == ["the lost slice is not back within cluster.elastic_wait_s=7s: restarting on 1 of 2 slices, "
                    "mesh.dp=1, train.grad_accum=2 (the same global batch of 8)"]
    free[0], e.looked_at = 0, -1e9
    assert not e.should_grow(True)  # none free beside its own
    free[0], e.looked_at = 1, -1e9  # the other slice is back (free beside the one the job holds)
    assert not e.should_grow(False)  # not before its first step
    assert e.should_grow(True) and e.growing
    releasing[0] = 1  # the job released its slice, which Ray shows as free a little later
    gang, grown = e.reserve(job, "a3", reserve, said.append)
    assert grown is job and asked[-1] == (2, 60) and not e.growing


def test_a_batch_the_remaining_slices_cannot_split_waits_for_the_slices(monkeypatch):
    job = config(3, "train.batch_size=6", "cluster.elastic_wait_s=7")
    e, said = Elastic.of(job.cluster, service=False), []
    monkeypatch.setattr(elastic, "free_slices", lambda cluster, hosts: 2)
    monkeypatch.setattr(elastic, "whole_slices", lambda cluster, hosts: 2)
    e.hosts_per_slice, e.lost = 2, True
    asked = []

    def reserve(cluster, name):
        asked.append(cluster.num_slices)
        raise ReservationError("no slice")

    with pytest.raises(ReservationError):
        e.reserve(job, "a2", reserve, said.append)
    assert asked == [3, 3] and e.slices == 3
    assert said == ["the lost slice is not back within cluster.elastic_wait_s=7s and train.batch_size=6 with "
                    "train.grad_accum=1 cannot be split over 2 of cluster.num_slices=3 slices: gradient accumulation "
                    "would have to be 3/2 micro-batches: waiting for 3 slices"]
