"""A new engine under the front end (its workers lost and restarted, or the whole service
restarted) brings every live adapter back from its last save, automatic or the client's, over the
NumPy fake backend and the real tinker SDK: a model that lost nothing goes on as if nothing
happened, one that lost steps is told once which step it is back at."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from fake_backend import FakeBackend
from test_api import BASE, DATA, KEY, fake_info, logprobs, running, train_steps
from tinker import types

from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.work import BaseInfo, ForwardBackward


@pytest.fixture(scope="module")
def info(tmp_path_factory) -> BaseInfo:
    return fake_info(tmp_path_factory.mktemp("tokenizer"))


def steps(url: str, model_id: str) -> tuple[int, int]:
    """(step, saved_step) from the raw `get_info` answer (the SDK's `get_info()` drops fields it
    does not know)."""
    answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id}, headers={"X-API-Key": KEY}).json()
    return answer["step"], answer["saved_step"]


def wait_saved(store: Store, model_id: str, step: int) -> None:
    """Until the automatic save after `step` is recorded (it runs in the engine's next step)."""
    deadline = time.monotonic() + 10
    while store.progress(model_id).saved_step != step:
        assert time.monotonic() < deadline, f"no automatic save of {model_id} at step {step}"
        time.sleep(0.01)


def test_a_new_engine_brings_back_every_adapter_from_its_last_save(info, tmp_path):
    store = Store(tmp_path)
    backend = FakeBackend(info)
    with running(backend, store, autosave_every=2) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        lost = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        kept = client.create_lora_training_client(base_model=BASE, rank=2, seed=2).result()
        new = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        train_steps(lost, DATA, 2)
        wait_saved(store, lost.model_id, 2)
        at_two = logprobs(lost)
        train_steps(lost, DATA, 1)  # step 3: after its last save
        train_steps(kept, DATA, 1)
        kept.save_state("one").result()
        kept_before, new_before = logprobs(kept), logprobs(new)

        backend.restart()  # its workers lost while no request ran: every slot empty

        np.testing.assert_array_equal(logprobs(kept)[0], kept_before[0])  # no step lost: no word of it
        np.testing.assert_array_equal(logprobs(new)[0], new_before[0])  # re-created from its seed
        assert steps(url, lost.model_id) == (2, 2)
        with pytest.raises(tinker.RequestFailedError, match="brought back from its last save, at step 2"):
            lost.forward(DATA, "cross_entropy").result()
        np.testing.assert_array_equal(logprobs(lost)[0], at_two[0])  # told once; it goes on from step 2
        train_steps(lost, DATA, 2)
        wait_saved(store, lost.model_id, 4)
        lost_before = logprobs(lost)
    store.close()

    store = Store(tmp_path)
    with running(FakeBackend(info), store, port=int(url.rsplit(":", 1)[1]), autosave_every=2):
        # The whole service restarted: the three come back from their saves at steps 4, 1 and 0.
        assert steps(url, lost.model_id) == (4, 4)
        for trainer, before in ((lost, lost_before), (kept, kept_before), (new, new_before)):
            np.testing.assert_array_equal(logprobs(trainer)[0], before[0])
        autosaves = list((tmp_path / "checkpoints" / lost.model_id / "autosave").iterdir())
        assert [str(p) for p in autosaves] == [store.progress(lost.model_id).saved_dir]  # the older ones removed
        client.close("success").result()


def test_a_request_in_flight_when_the_engine_is_lost_runs_again_or_fails_naming_the_step(info, tmp_path):
    store = Store(tmp_path)
    backend = FakeBackend(info)
    why = "the engine's workers were lost during this step (worker 1 exited -9)"
    with running(backend, store, autosave_every=1) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        saved = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        dirty = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
        train_steps(saved, DATA, 1)
        train_steps(dirty, DATA, 1)
        wait_saved(store, saved.model_id, 1)
        wait_saved(store, dirty.model_id, 1)
        before = logprobs(saved)

        dirty.forward_backward(DATA, "cross_entropy").result()  # a gradient no save holds
        backend.running.clear()
        backend.lose_next_run = why
        step = dirty.optim_step(types.AdamParams(learning_rate=0.2))
        time.sleep(0.5)  # in the engine when it is lost
        backend.running.set()
        with pytest.raises(tinker.RequestFailedError, match="worker 1 exited -9.*comes back from its last save, at "
                                                              "step 1"):
            step.result()
        assert steps(url, dirty.model_id) == (1, 1)
        assert len(train_steps(dirty, DATA, 1)) == 1  # told with the failed request: nothing more to say

        backend.running.clear()
        backend.lose_next_run = why
        again = saved.forward(DATA, "cross_entropy")  # its adapter comes back as it was: it runs again
        time.sleep(0.5)
        backend.running.set()
        np.testing.assert_array_equal(again.result().loss_fn_outputs[0]["logprobs"].to_numpy(), before[0])
        assert backend.engines == 2
        client.close("success").result()


def test_a_request_that_brings_the_engine_down_twice_fails_alone_and_the_others_go_on(info, tmp_path):
    """Two clients' requests share a step that loses the engine's workers; each runs again in a
    step of its own: the healthy one's answer is as if nothing happened, the one that brings the
    workers down again fails with the error, to its own client only."""
    store = Store(tmp_path)
    backend = FakeBackend(info)
    with running(backend, store) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        good = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        bad = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
        before = logprobs(good)
        backend.poisons = lambda work: isinstance(work, ForwardBackward) and work.model_id == bad.model_id
        backend.running.clear()
        blocker = good.forward(DATA, "cross_entropy")  # holds the scheduler in the backend while the next two queue
        time.sleep(0.5)
        healthy, poisoned = good.forward(DATA, "cross_entropy"), bad.forward(DATA, "cross_entropy")
        time.sleep(0.5)  # both queued: they share the next step
        backend.running.set()
        blocker.result()
        after = [record["logprobs"].to_numpy() for record in healthy.result(timeout=30).loss_fn_outputs]
        for a, b in zip(after, before, strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(tinker.RequestFailedError, match="killed by SIGSEGV.*each of the 2 times its workers "
                                                              "were lost, the last time alone"):
            poisoned.result(timeout=30)
        steps_with_bad = [works for works in backend.calls if any(backend.poisons(w) for w in works)]
        assert len(steps_with_bad) == 2 and [len([w for w in works if isinstance(w, ForwardBackward)])
                                             for works in steps_with_bad] == [2, 1]
        assert backend.engines == 2
        backend.poisons = None
        np.testing.assert_array_equal(logprobs(good)[0], before[0])  # the service goes on
        assert len(train_steps(bad, DATA, 1)) == 1  # and so does the client whose request failed


def test_after_a_restart_a_pipelined_step_is_told_once_and_its_optimizer_step_does_not_run(info, tmp_path):
    """A client submits forward_backward and optim_step together, not knowing its adapter lost a
    gradient in a restart: the first is told, the optimizer step (asked for the lost gradient)
    fails with a line pointing at it and does not run, and the next step goes on from the save."""
    store = Store(tmp_path)
    backend = FakeBackend(info)
    with running(backend, store, autosave_every=1) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        train_steps(trainer, DATA, 1)
        wait_saved(store, trainer.model_id, 1)
        at_one = logprobs(trainer)
        trainer.forward_backward(DATA, "cross_entropy").result()  # a gradient no save holds

        backend.restart()
        told = trainer.forward_backward(DATA, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=0.2))
        with pytest.raises(tinker.RequestFailedError, match="brought back from its last save, at step 1") as notice:
            told.result()
        with pytest.raises(tinker.RequestFailedError, match="has no gradient since: this optimizer step did not "
                                                              "run") as pointer:
            step.result()
        assert "brought back from its last save" not in str(pointer.value) and notice.value.request_id in str(
            pointer.value)
        assert steps(url, trainer.model_id) == (1, 1)
        np.testing.assert_array_equal(logprobs(trainer)[0], at_one[0])
        assert len(train_steps(trainer, DATA, 2)) == 2 and steps(url, trainer.model_id)[0] == 3
        client.close("success").result()
