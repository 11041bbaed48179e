"""Sessions and answers that end, over the NumPy fake backend and the real tinker SDK: a client that
goes silent loses its slots (its steps saved where it can load them), a closed session frees its
sampler snapshots, answers expire with a 410, and the store stays bounded over many requests."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from fake_backend import FakeBackend
from test_api import BASE, DATA, KEY, MAX_BYTES, fake_info, logprobs, running, serving, train_steps

from podtrain.orchestrator.serve.api import create_app
from podtrain.orchestrator.serve.lifetimes import Lifetimes
from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.work import BaseInfo

HEADERS = {"X-API-Key": KEY}


@pytest.fixture(scope="module")
def info(tmp_path_factory) -> BaseInfo:
    return fake_info(tmp_path_factory.mktemp("tokenizer"))


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_silent_client_loses_its_slots_its_steps_are_saved_and_a_new_client_gets_the_slots(info, tmp_path):
    backend, store = FakeBackend(info), Store(tmp_path)
    app = create_app(backend, store, api_key=KEY, max_request_bytes=MAX_BYTES, long_poll_s=0.5,
                     session_timeout_s=600)
    lifetimes: Lifetimes = app.state.service.lifetimes
    with serving(app) as url:
        silent = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = silent.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        train_steps(trainer, DATA, 2)
        trained = logprobs(trainer)
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = tinker.types.ModelInput.from_ints([2, 3])
        sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=2)).result()
        held = set(backend.adapters)
        assert len(held) == 2  # the adapter and its sampler snapshot
        session_id = store.model(trainer.model_id).session_id

        lifetimes.sweep(time.time() + 601)  # as if its heartbeats stopped ten minutes ago

        assert store.session(session_id).finished == "no heartbeat for 600s (serve.session_timeout_s)"
        wait_until(lambda: not held & set(backend.adapters), "the silent session's slots were not freed")
        with pytest.raises(tinker.APIStatusError, match="its session ended \\(no heartbeat for 600s") as refused:
            trainer.forward(DATA, "cross_entropy").result()
        assert refused.value.status_code == 410
        with pytest.raises(tinker.APIStatusError, match="its session ended"):
            sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=2)).result()

        fresh = tinker.ServiceClient(base_url=url, api_key=KEY)
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        saved = [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
        assert f"tinker://{trainer.model_id}/weights/session-end-step-2" in saved
        # Every slot is free: five new adapters and the silent one's state loaded into a sixth.
        for seed in range(5):
            fresh.create_lora_training_client(base_model=BASE, rank=2, seed=seed).result()
        resumed = fresh.create_training_client_from_state(f"tinker://{trainer.model_id}/weights/session-end-step-2").result()
        for a, b in zip(logprobs(resumed), trained, strict=True):
            np.testing.assert_array_equal(a, b)
        fresh.close("success").result()
    store.close()


def test_a_closed_session_frees_its_sampler_snapshots_unless_an_open_one_samples_them(info, tmp_path):
    backend, store = FakeBackend(info), Store(tmp_path)
    with running(backend, store, long_poll_s=0.5) as url:
        owner = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = owner.create_lora_training_client(base_model=BASE, rank=4).result()
        train_steps(trainer, DATA, 1)
        path = trainer.save_weights_for_sampler("one").result().path
        other = tinker.ServiceClient(base_url=url, api_key=KEY)
        prompt, params = tinker.types.ModelInput.from_ints([2, 3]), tinker.types.SamplingParams(max_tokens=2)
        for client in (owner, other):
            client.create_sampling_client(model_path=path).result().sample(prompt, 1, params).result()
        snapshots = {name for name in backend.adapters if name.startswith("sampler-slot")}
        assert len(snapshots) == 1
        owner.close("success").result()
        time.sleep(0.3)
        assert snapshots <= set(backend.adapters)  # the other session still samples from it
        other.close("success").result()
        wait_until(lambda: not snapshots & set(backend.adapters), "the closed sessions' snapshot kept its slot")
    store.close()


def test_a_session_silent_for_its_timeout_is_ended_by_the_service_itself(info, tmp_path):
    store = Store(tmp_path)
    with running(FakeBackend(info), store, session_timeout_s=0.5) as url:
        session_id = httpx.post(f"{url}/api/v1/create_session", headers=HEADERS, json={}).json()["session_id"]
        wait_until(lambda: store.session(session_id).finished is not None, "the silent session did not end", 5)
        beat = httpx.post(f"{url}/api/v1/session_heartbeat", headers=HEADERS, json={"session_id": session_id})
        assert beat.status_code == 410  # the SDK stops its heartbeats on a 410
        model = httpx.post(f"{url}/api/v1/create_model", headers=HEADERS,
                           json={"session_id": session_id, "model_seq_id": 0, "base_model": BASE,
                                 "lora_config": {"rank": 2}})
        assert model.status_code == 410 and "ended (no heartbeat for 0.5s" in model.json()["detail"]
    store.close()


def test_an_answer_is_kept_its_time_to_live_after_it_is_retrieved_then_is_a_410(info, tmp_path):
    store = Store(tmp_path)
    with running(FakeBackend(info), store, result_ttl_s=0.3) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
        step = {"model_id": trainer.model_id, "seq_id": 7, "adam_params": {"learning_rate": 0.1}}
        request_id = httpx.post(f"{url}/api/v1/optim_step", headers=HEADERS, json=step).json()["request_id"]

        def retrieve() -> httpx.Response:
            return httpx.post(f"{url}/api/v1/retrieve_future", headers=HEADERS, json={"request_id": request_id})

        wait_until(lambda: "try_again" not in retrieve().text, "the optimizer step did not finish")
        time.sleep(1.0)
        gone = retrieve()
        assert gone.status_code == 410 and "answers are kept 0.3s after they are first retrieved" in gone.text
        # A retried submission still finds its request, and does not run again.
        assert httpx.post(f"{url}/api/v1/optim_step", headers=HEADERS, json=step).json()["request_id"] == request_id
        client.close("success").result()
    store.close()


def test_ten_thousand_answers_leave_the_store_bounded(tmp_path):
    store = Store(tmp_path)
    lifetimes = Lifetimes(store, scheduler=None, session_timeout_s=0, result_ttl_s=0.05, tombstone_s=0.05)
    answer = bytes(4096)

    def size() -> int:
        return sum(path.stat().st_size for path in tmp_path.glob("serve.sqlite*"))

    sizes = []
    for i in range(10_000):
        request_id, _ = store.add_future("forward", "m", f"forward#m#{i}")
        store.complete_future(request_id, answer, "application/json")
        store.retrieved(request_id)
        if i % 500 == 499:
            lifetimes.sweep(time.time())
            sizes.append(size())
    store.close()
    # Unexpired, the answers alone would take 40 MB; expired, the file (with its write-ahead log, which
    # SQLite reuses after each checkpoint of 1000 pages) stops growing.
    assert max(sizes) < 16 * 2**20, sizes
    assert sizes[-1] <= 1.5 * sizes[len(sizes) // 2], sizes  # no growth in the second half


def test_a_deleted_checkpoint_frees_its_files_and_leaves_the_listing_unless_it_is_still_used(info, tmp_path):
    store = Store(tmp_path)
    with running(FakeBackend(info), store, long_poll_s=0.5) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
        train_steps(trainer, DATA, 1)
        one = trainer.save_state("one").result().path
        train_steps(trainer, DATA, 1)
        two = trainer.save_state("two").result().path
        snapshot = trainer.save_weights_for_sampler("s").result().path
        client.create_sampling_client(model_path=snapshot).result()
        model_id = trainer.model_id

        def listed() -> set[str]:
            return {c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints}

        with pytest.raises(tinker.BadRequestError, match="is the save live model .* comes back from after a restart"):
            rest.delete_checkpoint(model_id, "weights/two").result()
        with pytest.raises(tinker.BadRequestError, match="is sampled from by sampling session"):
            rest.delete_checkpoint_from_tinker_path(snapshot).result()
        assert listed() == {one, two, snapshot}

        rest.delete_checkpoint(model_id, "weights/one").result()
        assert listed() == {two, snapshot} and not store.checkpoint_dir(model_id, "state", "one").exists()
        with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
            client.create_training_client_from_state(one).result()

        client.close("success").result()  # its session ends: nothing samples the snapshot, the model is unloaded
        for path in (snapshot, two):
            rest.delete_checkpoint_from_tinker_path(path).result()
        assert listed() == set() and not (tmp_path / "checkpoints" / model_id / "weights" / "two").exists()
        assert store.model(model_id).last_checkpoint is None
    store.close()
