"""The service's HTTP front end driven by the real tinker SDK, over the NumPy fake backend: training,
checkpoints, sampling, restarts, and a clear, quick error for each bad request."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import uvicorn
from fake_backend import FakeBackend
from tinker import types

from podtrain.orchestrator.serve.api import create_app
from podtrain.orchestrator.serve.scheduler import Job, Scheduler
from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.translate import lora_targets, stops, string_sequences
from podtrain.orchestrator.serve.wire import LoraBody
from podtrain.orchestrator.serve.work import (
    BaseInfo,
    Create,
    Datum,
    ForwardBackward,
    OptimStep,
    Sample,
    Save,
    ServeError,
)

KEY = "tml-podtrain-test-key"
BASE = "fake/tiny-lm"
MAX_BYTES = 8192
WORDS = ["<unk>", "</s>", *(f"w{i}" for i in range(30))]


@pytest.fixture(scope="module")
def info(tmp_path_factory) -> BaseInfo:
    return fake_info(tmp_path_factory.mktemp("tokenizer"))


def fake_info(directory: Path) -> BaseInfo:
    """The fake model's description, its tokenizer a word-level one saved for AutoTokenizer in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return BaseInfo(base_model=BASE, tokenizer_id=str(directory), model_type="llama", vocab_size=len(WORDS),
                    max_seq_len=256, max_rank=8, max_adapters=6, eos_token_ids=(1,), max_sample_tokens=128)


@contextmanager
def running(backend: FakeBackend, store: Store, port: int = 0, **options) -> Iterator[str]:
    """The app served by uvicorn in a thread, on `port` (0: a free one); yields its URL."""
    with serving(create_app(backend, store, api_key=KEY, max_request_bytes=MAX_BYTES, **options), port) as url:
        yield url


@contextmanager
def serving(app, port: int = 0) -> Iterator[str]:
    """`app` served by uvicorn in a thread, on `port` (0: a free one); yields its URL."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def service(info, tmp_path_factory) -> Iterator[tuple[str, FakeBackend, Store]]:
    from tokenizers import Tokenizer

    backend, store = FakeBackend(info), Store(tmp_path_factory.mktemp("run"))
    tokenizer = Tokenizer.from_file(str(Path(info.tokenizer_id) / "tokenizer.json"))
    with running(backend, store, long_poll_s=0.5, decode=lambda ids: tokenizer.decode(list(ids))) as url:
        yield url, backend, store


@pytest.fixture
def url(service) -> str:
    return service[0]


@contextmanager
def session(url: str) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        yield client
    finally:
        client.close("success").result()


@pytest.fixture
def client(url) -> Iterator[tinker.ServiceClient]:
    with session(url) as client:
        yield client


def falling(values: list[float]) -> bool:
    return bool(np.all(np.diff(values) < 0))


def datum(tokens: list[int], targets: list[int], weights: list[float] | None = None) -> types.Datum:
    inputs = {"target_tokens": np.array(targets, np.int64)}
    if weights is not None:
        inputs["weights"] = np.array(weights, np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


DATA = [datum([2, 3, 4, 5], [3, 4, 5, 6], [0.0, 1.0, 1.0, 1.0]), datum([7, 8], [8, 9])]


def train_steps(trainer, data, steps: int, learning_rate: float = 0.2) -> list[float]:
    """The loss of each step, each forward-backward submitted with its optimizer step before waiting."""
    losses = []
    for _ in range(steps):
        forward_backward = trainer.forward_backward(data, "cross_entropy")
        optim = trainer.optim_step(types.AdamParams(learning_rate=learning_rate))
        losses.append(forward_backward.result().metrics["loss:sum"])
        optim.result()
    return losses


def logprobs(trainer, data=DATA) -> list[np.ndarray]:
    output = trainer.forward(data, "cross_entropy").result()
    return [record["logprobs"].to_numpy() for record in output.loss_fn_outputs]


def test_training_lowers_the_loss(client):
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    first = trainer.forward_backward(DATA, "cross_entropy").result()
    assert [record["logprobs"].shape for record in first.loss_fn_outputs] == [[4], [2]]
    assert first.loss_fn_outputs[0]["elementwise_loss"].to_numpy()[0] == 0.0  # weight 0
    trainer.optim_step(types.AdamParams(learning_rate=0.2)).result()
    losses = train_steps(trainer, DATA, 4)
    assert falling([first.metrics["loss:sum"], *losses])


def test_a_batch_past_half_the_body_limit_goes_in_serial_chunks(client):
    trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
    data = [datum([2 + i] * 200, [3 + i] * 200) for i in range(3)]
    output = trainer.forward_backward(data, "cross_entropy").result()
    losses = [record["elementwise_loss"].to_numpy().sum() for record in output.loss_fn_outputs]
    assert len(losses) == 3 and output.metrics["loss:sum"] == pytest.approx(sum(losses), rel=1e-5)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_take_sampling_logprobs_and_advantages(client, loss_fn):
    trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
    inputs = {"target_tokens": np.array([3, 4, 5]), "logprobs": np.full(3, -3.0, np.float32),
              "advantages": np.array([1.0, -0.5, 2.0], np.float32)}
    data = [types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4]), loss_fn_inputs=inputs)]
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} if loss_fn in ("ppo", "cispo") else None
    output = trainer.forward_backward(data, loss_fn, config).result()
    assert output.loss_fn_outputs[0]["logprobs"].shape == [3]
    trainer.optim_step(types.AdamParams(learning_rate=0.1)).result()


def test_lora_targets_follow_the_switches_and_the_model(info):
    attention, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    assert lora_targets(info, LoraBody(rank=1)) == (*attention, *mlp, "lm_head")
    assert lora_targets(info, LoraBody(rank=1, train_mlp=False, train_unembed=False)) == attention
    deepseek = replace(info, model_type="deepseek_v3")
    assert lora_targets(deepseek, LoraBody(rank=1, train_unembed=False)) == (
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *mlp, "experts")
    with pytest.raises(ServeError, match="at least one of train_attn"):
        lora_targets(info, LoraBody(rank=1, train_attn=False, train_mlp=False, train_unembed=False))


def test_get_info_and_tokenizer(client, info):
    trainer = client.create_lora_training_client(base_model=BASE, rank=2, train_unembed=False).result()
    model = trainer.get_info()
    assert (model.model_data.model_name, model.lora_rank, model.is_lora) == (BASE, 2, True)
    assert model.model_data.tokenizer_id == info.tokenizer_id
    tokenizer = trainer.get_tokenizer()
    assert tokenizer.encode("w0 w5", add_special_tokens=False) == [2, 7]


def test_save_and_load_state(client):
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(trainer, DATA, 2)
    path = trainer.save_state("step-2").result().path
    assert path == f"tinker://{trainer.model_id}/weights/step-2"
    saved = logprobs(trainer)
    train_steps(trainer, DATA, 2)
    assert not np.allclose(logprobs(trainer)[0], saved[0])
    with pytest.warns(FutureWarning):
        trainer.load_state(path).result()
    np.testing.assert_allclose(logprobs(trainer)[0], saved[0], rtol=1e-6)
    for resumed in (client.create_training_client_from_state(path).result(),
                    client.create_training_client_from_state_with_optimizer(path).result()):
        assert resumed.model_id != trainer.model_id and resumed.get_info().lora_rank == 4
        np.testing.assert_allclose(logprobs(resumed)[1], saved[1], rtol=1e-6)
        assert len(train_steps(resumed, DATA, 1)) == 1


def test_sampling_from_saved_weights_and_the_base_model(client):
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(trainer, DATA, 3)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([2, 3, 4])
    params = types.SamplingParams(max_tokens=5, seed=7, stop=[])
    response = sampler.sample(prompt, num_samples=2, sampling_params=params, include_prompt_logprobs=True).result()
    assert len(response.sequences) == 2 and all(len(sequence.tokens) == 5 for sequence in response.sequences)
    assert len({sequence.sequence_id for sequence in response.sequences}) == 2
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == 3
    again = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]

    path = trainer.save_weights_for_sampler("sampler-3").result().path
    assert path == f"tinker://{trainer.model_id}/sampler_weights/sampler-3"
    named = client.create_sampling_client(model_path=path).result()
    assert [s.tokens for s in named.sample(prompt, 2, params).result().sequences] == [s.tokens for s in again.sequences]

    base = client.create_sampling_client(base_model=BASE).result()
    greedy = types.SamplingParams(max_tokens=1, temperature=0.0)
    first = base.sample(prompt, 1, greedy).result().sequences[0].tokens[0]
    stopped = base.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[first])).result()
    stopped = stopped.sequences[0]
    assert (stopped.tokens, stopped.stop_reason) == ([first], "stop")
    last_only = base.sample(prompt, 1, greedy, include_prompt_logprobs=True, prompt_logprobs_last_n=1).result()
    assert last_only.prompt_logprobs[:2] == [None, None] and last_only.prompt_logprobs[2] is not None


def test_stop_strings_cut_each_sequence_after_the_token_that_completes_one(client):
    sampler = client.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([2, 3, 4])
    params = types.SamplingParams(max_tokens=8, seed=11, stop=[1])  # end of sequence, as with stop strings
    free = [(s.tokens, s.stop_reason) for s in sampler.sample(prompt, 3, params).result().sequences]
    stop = " ".join(WORDS[t] for t in free[0][0][2:4])  # spans two tokens: no single token is it
    cut = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=8, seed=11, stop=[stop, "none of these"]))
    for (tokens, reason), got in zip(free, cut.result().sequences, strict=True):
        text = [" ".join(WORDS[t] for t in tokens[:end]) for end in range(len(tokens) + 1)]
        end = next((e for e in range(len(tokens) + 1) if stop in text[e]), None)
        assert (got.tokens, got.stop_reason) == ((tokens, reason) if end is None else (tokens[:end], "stop"))
    one = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=11, stop=stop)).result().sequences[0]
    assert one.tokens == cut.result().sequences[0].tokens == free[0][0][:4]


def test_stop_lists_of_ids_and_strings_together_or_strings_without_a_tokenizer_are_refused(info):
    assert stops(None, info, None) == (info.eos_token_ids, ())
    assert stops([4, 5], info, None) == ((4, 5), ())
    assert stops("w1", info, str) == (info.eos_token_ids, ("w1",))
    with pytest.raises(ServeError, match="expected token ids or strings, found both"):
        stops(["w1", 3], info, str)
    with pytest.raises(ServeError, match="stop as strings without a tokenizer on the service"):
        stops(["w1"], info, None)


def test_stop_strings_carry_their_own_tokens_where_those_spell_them(info):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(info.tokenizer_id) / "tokenizer.json"))
    encode, decode = (lambda text: tokenizer.encode(text).ids), (lambda ids: tokenizer.decode(list(ids)))
    # "w3  w29x" encodes to w3 and the unknown token, whose text does not hold it: the front end's cut alone.
    assert string_sequences(("w3 w4", "w3  w29x", "w5"), info, decode, encode) == ((5, 6), (7,))
    assert string_sequences(("w3 w4",), info, decode, None) == ()


def test_closing_a_session_frees_its_adapters(url, service):
    with session(url) as client:
        model_id = client.create_lora_training_client(base_model=BASE, rank=2).result().model_id
        assert model_id in service[1].adapters
    deadline = time.monotonic() + 5
    while model_id in service[1].adapters:
        assert time.monotonic() < deadline, "the session's adapter was not unloaded"
        time.sleep(0.01)


def test_two_clients_train_interleaved(url):
    with session(url) as first, session(url) as second:
        trainers = [first.create_lora_training_client(base_model=BASE, rank=2).result(),
                    second.create_lora_training_client(base_model=BASE, rank=4).result()]
        data = [[datum([2, 3], [10, 11])], [datum([2, 3], [20, 21])]]
        losses: list[list[float]] = [[], []]
        adam = types.AdamParams(learning_rate=0.2)
        for _ in range(4):
            pending = [(trainer.forward_backward(batch, "cross_entropy"), trainer.optim_step(adam))
                       for trainer, batch in zip(trainers, data, strict=True)]
            for run, (forward_backward, optim) in zip(losses, pending, strict=True):
                run.append(forward_backward.result().metrics["loss:sum"])
                optim.result()
        assert falling(losses[0]) and falling(losses[1])
        # Each adapter learnt its own targets.
        assert logprobs(trainers[0], data[0])[0].sum() > logprobs(trainers[1], data[0])[0].sum()


def datum_work() -> Datum:
    return Datum(tokens=np.array([2, 3], np.int32),
                 inputs={"target_tokens": np.array([3, 4], np.int32), "weights": np.ones(2, np.float32)})


def test_the_scheduler_runs_several_models_in_one_call_in_seq_order(info, tmp_path):
    backend, store = FakeBackend(info), Store(tmp_path)
    scheduler = Scheduler(backend, store, notify=lambda ids: None, sampler_slots=1)
    scheduler.run([Job(None, name, 0, Create(model_id=name, rank=2, targets=("q_proj",)), lambda _: (b"", ""))
                   for name in ("a", "b")])
    fb = ForwardBackward(model_id="a", data=(datum_work(),), loss_fn="cross_entropy")
    step = OptimStep(model_id="a", adam={"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                         "weight_decay": 0.0, "grad_clip_norm": 0.0})
    arrivals = [("a", 2, step), ("b", 1, replace(fb, model_id="b")), ("a", 1, fb)]
    jobs = [Job(store.add_future("work", key, None)[0], key, seq, work, lambda _: (b"ok", "text/plain"))
            for key, seq, work in arrivals]
    scheduler.run(jobs)
    assert [(type(work).__name__, work.model_id) for work in backend.calls[-1]] == [
        ("ForwardBackward", "a"), ("ForwardBackward", "b"), ("OptimStep", "a")]
    assert all(store.future(job.request_id).status == "done" for job in jobs)


def test_the_scheduler_loads_sampler_weights_once_per_directory(info, tmp_path):
    backend, store = FakeBackend(info), Store(tmp_path)
    scheduler = Scheduler(backend, store, notify=lambda ids: None, sampler_slots=1)
    scheduler.run([Job(None, "a", 0, Create(model_id="a", rank=2, targets=("q_proj",)), lambda _: (b"", ""))])
    for name in ("one", "two"):
        scheduler.run([Job(None, "a", 1, Save(model_id="a", path=str(tmp_path / name), optimizer=False),
                           lambda _: (b"", ""))])
    sample = Sample(model_id=None, prompt=np.array([2, 3], np.int32), max_tokens=2)

    def sample_from(directory: Path) -> str:
        request_id = store.add_future("sample", "s", None)[0]
        scheduler.run([Job(request_id, "s", 0, sample, lambda _: (b"ok", "text/plain"), str(directory))])
        return request_id

    kinds = []
    for directory in (tmp_path / "one", tmp_path / "one", tmp_path / "two"):
        assert store.future(sample_from(directory)).status == "done"
        kinds.append([type(work).__name__ for work in backend.calls[-1]])
    assert kinds == [["Load", "Sample"], ["Sample"], ["Unload", "Load", "Sample"]]
    failed = store.future(sample_from(tmp_path / "missing"))
    assert failed.status == "error" and "no saved adapter" in failed.error and failed.category == "user"


def test_a_broken_engine_fails_the_futures_instead_of_hanging(info, tmp_path):
    class Broken(FakeBackend):
        def run(self, works, generation=None):
            return []

    store = Store(tmp_path)
    settled = threading.Event()
    scheduler = Scheduler(Broken(info), store, notify=lambda ids: settled.set(), sampler_slots=1)
    scheduler.start()
    try:
        request_id = store.add_future("create_model", "a", None)[0]
        scheduler.submit(Job(request_id, "a", 0, Create(model_id="a", rank=2, targets=("q_proj",)),
                             lambda _: (b"", "")))
        assert settled.wait(10)
    finally:
        scheduler.stop()
    failed = store.future(request_id)
    assert (failed.status, failed.category) == ("error", "server") and "the service failed" in failed.error


def test_a_restarted_service_lists_the_model_and_brings_it_back_from_its_checkpoint(info, tmp_path):
    store = Store(tmp_path)
    with running(FakeBackend(info), store) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = client.create_lora_training_client(base_model=BASE, rank=4, user_metadata={"run": "r1"}).result()
        train_steps(trainer, DATA, 2)
        path = trainer.save_state("keep").result().path
        saved = logprobs(trainer)
    store.close()

    store = Store(tmp_path)
    orphan = store.add_future("forward", trainer.model_id, None)[0]  # pending when the service stopped
    with running(FakeBackend(info), store, port=int(url.rsplit(":", 1)[1])):
        assert store.future(orphan).error == "the service restarted before this request ran"
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        run = rest.get_training_run(trainer.model_id).result()
        assert (run.base_model, run.lora_rank, run.last_checkpoint.tinker_path) == (BASE, 4, path)
        assert run.user_metadata == {"run": "r1"}
        assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints] == [path]
        assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
        np.testing.assert_allclose(logprobs(trainer)[0], saved[0], rtol=1e-6)  # back from its checkpoint
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        np.testing.assert_allclose(logprobs(resumed)[0], saved[0], rtol=1e-6)
        assert train_steps(trainer, DATA, 1) == train_steps(resumed, DATA, 1)
        client.close("success").result()


def test_results_arrive_after_several_long_polls(client, service):
    backend = service[1]
    trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
    backend.running.clear()
    try:
        future = trainer.forward(DATA, "cross_entropy")
        time.sleep(1.2)
        assert not future.future().done()
    finally:
        backend.running.set()
    assert len(future.result(timeout=10).loss_fn_outputs) == 2


def test_raw_requests(url, client):
    """What the SDK does not exercise: the key check, unload_model, and a resubmitted request."""
    assert httpx.get(f"{url}/api/v1/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{url}/api/v1/get_server_capabilities").status_code == 401
    trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
    headers = {"X-API-Key": KEY}
    step = {"model_id": trainer.model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}}
    first, again = (httpx.post(f"{url}/api/v1/optim_step", headers=headers, json=step).json() for _ in range(2))
    assert first["request_id"] == again["request_id"]
    unload = httpx.post(f"{url}/api/v1/unload_model", headers=headers, json={"model_id": trainer.model_id}).json()
    done = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, json={"request_id": unload["request_id"]})
    assert done.json() == {"type": "unload_model", "model_id": trainer.model_id}
    with pytest.raises(tinker.BadRequestError, match="is unloaded"):
        trainer.forward(DATA, "cross_entropy").result()
    unsupported = httpx.post(f"{url}/api/v1/save_weights_external", headers=headers, json={})
    assert unsupported.status_code == 400 and "not supported by podtrain serve" in unsupported.text
    streamed = httpx.post(f"{url}/api/v1/optim_step", headers=headers, content=iter([b"{" + b" " * MAX_BYTES, b"}"]))
    assert streamed.status_code == 413 and "request body: expected at most" in streamed.text
    # Finishing is first-wins: the client's own close() after this one still succeeds.
    finish = f"{url}/api/v1/sessions/{client.holder.get_session_id()}/finish"
    assert httpx.post(finish, headers=headers, json={"reason": {"type": "errored"}}).status_code == 200


def _protobuf_request(weights: dict) -> bytes:
    """A forward_backward request as the SDK encodes it, with the weights tensor given as fields."""
    from tinker.proto import tinker_public_pb2 as pb

    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([2, 3], np.int32).tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = pb.DTYPE_INT64, np.array([3, 4], np.int64).tobytes()
    targets.shape.append(2)
    tensor = datum.loss_fn_inputs["weights"]
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.shape.extend(weights.pop("shape"))
    if "dense" in weights:
        tensor.dense = weights["dense"]
    else:
        for key, value in weights.items():
            setattr(tensor.sparse_csr, key, value)
    return message.SerializeToString()


@pytest.mark.parametrize("weights, message", [
    ({"shape": [2], "dense": b"\0" * 5}, "data[0].loss_fn_inputs['weights']: 5 bytes are not a whole number of "
                                         "float32 values (4 bytes each)"),
    ({"shape": [1, 2], "values": np.ones(1, np.float32).tobytes(), "crow_indices": np.array([0, 1]).tobytes(),
      "col_indices": np.array([-1]).tobytes()}, "data[0].loss_fn_inputs['weights']: sparse indices do not fit shape"),
    ({"shape": [1, 2], "values": np.ones(1, np.float32).tobytes(), "crow_indices": np.array([0, 1]).tobytes(),
      "col_indices": np.array([2]).tobytes()}, "columns in [0, 2)"),
    ({"shape": [1, 2], "values": np.ones(1, np.float32).tobytes(), "crow_indices": np.array([1, 0]).tobytes(),
      "col_indices": np.array([0]).tobytes()}, "row pointers from 0 to the 1 values"),
])
def test_malformed_tensors_on_the_wire_are_a_400_naming_the_field(url, client, weights, message):
    """Buffers the SDK would not send (a 5xx would make it retry): each one a 400, the next client served."""
    headers = {"X-API-Key": KEY, "Content-Type": "application/x-protobuf"}
    answer = httpx.post(f"{url}/api/v1/forward_backward", headers=headers, content=_protobuf_request(weights))
    assert answer.status_code == 400 and message in answer.text, answer.text
    other = client.create_lora_training_client(base_model=BASE, rank=2).result()
    assert len(other.forward(DATA, "cross_entropy").result().loss_fn_outputs) == 2


def test_without_an_api_key_every_caller_is_served(info, tmp_path):
    from fastapi.testclient import TestClient

    app = create_app(FakeBackend(info), Store(tmp_path), api_key=None, max_request_bytes=MAX_BYTES)
    with TestClient(app) as http:
        models = http.get("/api/v1/get_server_capabilities").json()["supported_models"]
    assert [(model["model_name"], model["max_context_length"]) for model in models] == [(BASE, 256)]


def _image_datum() -> types.Datum:
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)
    return types.Datum(model_input=types.ModelInput(chunks=[image]), loss_fn_inputs={"target_tokens": np.array([2, 3])})


def _train(data: list[types.Datum], loss_fn: str = "cross_entropy") -> Callable:
    return lambda client, trainer, sampler: trainer.forward_backward(data, loss_fn).result()


def _create(**options) -> Callable:
    return lambda client, trainer, sampler: client.create_lora_training_client(**options).result()


def _with_wrong_key(client, trainer, sampler):
    other = tinker.ServiceClient(base_url=trainer.holder._base_url, api_key="tml-wrong")
    return other.create_lora_training_client(base_model=BASE).result()


def _sample_until_nothing(client, trainer, sampler):
    params = types.SamplingParams(max_tokens=2, stop=["w1", ""])
    return sampler.sample(types.ModelInput.from_ints([2]), 1, params).result()


def _sample_too_long(client, trainer, sampler):
    return sampler.sample(types.ModelInput.from_ints([2] * 100), 1, types.SamplingParams(max_tokens=29)).result()


def _resume_unknown(client, trainer, sampler):
    return client.create_training_client_from_state("tinker://x:train:0/weights/y").result()


BAD_REQUESTS: dict[str, tuple[Callable, str]] = {
    "unknown base model": (_create(base_model="other/model"), f"this service holds {BASE!r}, found 'other/model'"),
    "rank above the maximum": (_create(base_model=BASE, rank=64), "lora_config.rank: expected 1 to 8, found 64"),
    "token outside the vocabulary": (_train([datum([2, 99], [3, 4])]), "token ids must be in [0, 32), found 99"),
    "loss input length": (_train([datum([2, 3], [3, 4], [1.0])]), "data[0].loss_fn_inputs.weights: expected 2 values"),
    "missing loss input": (_train([datum([2, 3], [3, 4])], "ppo"), "missing ['logprobs', 'advantages']"),
    "unknown loss": (_train(DATA, "nope"), "loss_fn: expected one of"),
    "unsupported loss": (_train(DATA, "gspo"), "loss_fn: 'gspo' is not supported by podtrain serve"),
    "sequence too long": (_train([datum([2] * 257, [3] * 257)]), "257 tokens exceed serve.max_seq_len (256)"),
    "sampled sequence too long": (_sample_too_long, "exceeds the 128 tokens a sampled sequence may hold "
                                                    "(serve.max_sample_tokens)"),
    "NaN weight": (_train([datum([2, 3], [3, 4], [float("nan"), 1.0])]),
                   "data[0].loss_fn_inputs['weights']: expected finite numbers, found nan at index 0"),
    "integer weights": (_train([types.Datum(model_input=types.ModelInput.from_ints([2, 3]), loss_fn_inputs={
        "target_tokens": np.array([3, 4]), "weights": np.array([1, 1], np.int64)})]),
        "data[0].loss_fn_inputs['weights']: expected float32 values, found int64"),
    "body over the limit": (_train([datum([2] * 800, [3] * 800)]), f"request body: expected at most {MAX_BYTES} bytes"),
    "image input": (_train([_image_datum()]), "image chunks (only encoded text) is not supported"),
    "empty stop string": (_sample_until_nothing, "sampling_params.stop: a stop string must not be empty"),
    "unknown checkpoint": (_resume_unknown, "unknown checkpoint 'tinker://x:train:0/weights/y'"),
    "bad API key": (_with_wrong_key, "X-API-Key"),
}


@pytest.fixture(scope="module")
def clients(service) -> Iterator[tuple]:
    """A training client and a sampling client that the bad requests are sent from."""
    with session(service[0]) as client:
        trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
        yield client, trainer, client.create_sampling_client(base_model=BASE).result()


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_fail_quickly_with_their_reason(case, clients, client):
    send, message = BAD_REQUESTS[case]
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        send(*clients)
    assert message in str(raised.value) and time.monotonic() - start < 10
    other = client.create_lora_training_client(base_model=BASE, rank=2).result()
    assert len(other.forward(DATA, "cross_entropy").result().loss_fn_outputs) == 2


def test_sampler_snapshots_give_their_slots_to_new_adapters(info, tmp_path):
    """Snapshots for sampling only cache saved weights: with every slot taken by an adapter and two
    snapshots, new adapters still get slots (the snapshots' first), and a snapshot loads again when
    sampled."""
    with running(FakeBackend(replace(info, max_adapters=3)), Store(tmp_path)) as url, session(url) as client:
        trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
        prompt, params = types.ModelInput.from_ints([2, 3]), types.SamplingParams(max_tokens=2, seed=1)
        paths = [trainer.save_weights_for_sampler(name).result().path for name in ("a", "b")]
        samplers = [client.create_sampling_client(model_path=path).result() for path in paths]
        first = [s.tokens for s in samplers[0].sample(prompt, 1, params).result().sequences]
        samplers[1].sample(prompt, 1, params).result()
        others = [client.create_lora_training_client(base_model=BASE, rank=2).result() for _ in range(2)]
        for other in others:
            assert len(other.forward(DATA, "cross_entropy").result().loss_fn_outputs) == 2
        unload = httpx.post(f"{url}/api/v1/unload_model", headers={"X-API-Key": KEY},
                            json={"model_id": others[1].model_id}).json()
        httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": KEY}, json=unload)
        assert [s.tokens for s in samplers[0].sample(prompt, 1, params).result().sequences] == first


def test_an_engine_refusal_comes_back_in_the_future(info, tmp_path):
    with running(FakeBackend(replace(info, max_adapters=1)), Store(tmp_path)) as url, session(url) as client:
        trainer = client.create_lora_training_client(base_model=BASE, rank=2).result()
        path = trainer.save_state("full").result().path
        start = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="all 1 adapter slots are taken") as raised:
            client.create_training_client_from_state(path).result()
        assert raised.value.category == types.RequestErrorCategory.User and time.monotonic() - start < 10
