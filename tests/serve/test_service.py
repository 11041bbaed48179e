"""`podtrain serve` as users meet it: a real service process on a tiny HF Llama, driven by the
unchanged `tinker` SDK. An SFT loop learns; two clients' adapters stay apart; sampler weights are
a PEFT adapter that `peft` and `podtrain generate` read to the service's logits and tokens; a bad
request is one clear error and the service goes on; a restarted service gives back saved state."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import tinker
import torch
from cluster_fixtures import env, fake_tpu_slices, on_tpu
from hf_fixtures import make_hf_model
from service_fixtures import KEY, Service, hf_base
from tinker import types
from train_fixtures import ROOT

pytestmark = pytest.mark.slow
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_base(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def service(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("service")
    running = Service(tmp, base, tmp / "runs" / "svc", "cluster.kind=none")
    yield running
    _close_sessions(running)
    assert running.stop() == 0, running.output()


@pytest.fixture(scope="module")
def paging_service(tmp_path_factory, base):
    """4 device slots for 64 live adapters, 16 of them in host memory and the rest on disk."""
    tmp = tmp_path_factory.mktemp("paging")
    running = Service(tmp, base, tmp / "runs" / "paging", "cluster.kind=none", "serve.max_adapters=4",
                      "serve.max_live_adapters=64", "serve.host_adapters=16", name="paging")
    yield running
    _close_sessions(running)
    assert running.stop() == 0, running.output()


_OPEN: list[tuple] = []  # (service, client) of the running test


def _client(service) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=service.url, api_key=KEY)
    _OPEN.append((service, client))
    return client


def _close_sessions(service=None) -> None:
    """Ends the sessions of `service`'s clients (of every running service's when None), as a
    user's `close()` does: a session left open goes on heartbeating at a service that is gone."""
    for entry in [e for e in _OPEN if service is None or e[0] is service]:
        _OPEN.remove(entry)
        if entry[0].proc.poll() is None:
            entry[1].close("success").result(timeout=30)


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    _close_sessions()


class WORDS:
    """The base's tokenizer without loading it: "w<n>" is token n."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(word[1:]) for word in text.split()]


def _chat_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """prompt then answer, the loss on the answer's tokens only (an SFT mask)."""
    p, a = tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(answer, add_special_tokens=False)
    tokens = p + a
    weights = np.array([0.0] * (len(p) - 1) + [1.0] * len(a), np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64), "weights": weights})


def _logprobs(trainer, data) -> list[np.ndarray]:
    out = trainer.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].tolist(), np.float32) for o in out.loss_fn_outputs]


def test_an_sft_loop_learns_and_another_clients_steps_leave_it_alone(service, base):
    client = _client(service)
    rest = tinker.RestClient(base_url=service.url, api_key=KEY)
    assert base.name in [m.model_name for m in rest.get_server_capabilities().result().supported_models]
    a = client.create_lora_training_client(base_model=base.name, rank=4).result()
    b = client.create_lora_training_client(base_model=base.name, rank=8, train_unembed=False).result()
    tokenizer = a.get_tokenizer()
    assert a.get_info().model_data.tokenizer_id == str(base)
    rng = np.random.default_rng(0)
    sft = [_chat_datum(tokenizer, " ".join(f"w{i}" for i in rng.integers(2, 128, 6)), "w9 w8 w7 w6 </s>")
           for _ in range(4)]
    other = [_chat_datum(tokenizer, "w3 w4 w5", "w60 w61 w62")]
    losses = []
    for step in range(8):
        fb = a.forward_backward(sft, "cross_entropy")
        if step % 2:  # b's steps land between a's
            b.forward_backward(other, "cross_entropy").result()
            b.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
        a.optim_step(ADAM).result()
    assert losses[-1] < 0.5 * losses[0], losses
    before = _logprobs(a, sft)
    for _ in range(2):
        b.forward_backward(other, "cross_entropy").result()
        b.optim_step(ADAM).result()
    for x, y in zip(before, _logprobs(a, sft), strict=True):
        np.testing.assert_array_equal(x, y)


def test_sampler_weights_are_a_peft_adapter_with_the_services_logits_and_tokens(service, base, tmp_path):
    from peft import PeftModel

    client = _client(service)
    trainer = client.create_lora_training_client(base_model=base.name, rank=4, seed=3).result()
    tokenizer = trainer.get_tokenizer()
    data = [_chat_datum(tokenizer, "w5 w6 w7", "w20 w21 w22 w23")]
    for _ in range(3):
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(ADAM).result()
    saved = trainer.save_weights_for_sampler("peft-check").result().path
    directory = service.run_dir / "checkpoints" / trainer.model_id / "sampler_weights" / "peft-check"
    assert saved.startswith("tinker://") and (directory / "adapter_config.json").is_file()
    # peft on the HF base gives the service's logprobs.
    hf = PeftModel.from_pretrained(make_hf_model("llama"), str(directory)).eval()
    tokens = data[0].model_input.to_ints()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    targets = torch.tensor(data[0].loss_fn_inputs["target_tokens"].tolist())
    want = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), targets]
    np.testing.assert_allclose(_logprobs(trainer, data)[0], want.numpy(), rtol=1e-4, atol=1e-4)
    # Greedy sampling from those weights is what `podtrain generate` makes with the PEFT adapter.
    sampler = client.create_sampling_client(model_path=saved).result()
    prompt = tokenizer.encode("w5 w6 w7", add_special_tokens=False)
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens
    generated = subprocess.run(
        [sys.executable, "-m", "podtrain.launch.cli", "generate", f"checkpoint={base}", f"adapter={directory}",
         "prompt=w5 w6 w7", "max_new_tokens=6", "stop="],
        cwd=ROOT, env=env(tmp_path, 1), capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr
    lines = generated.stdout.splitlines()
    completion = lines[next(i for i, line in enumerate(lines) if line.startswith("--- completion 1")) + 1]
    assert tokenizer.decode(sampled).split() == completion.split(), generated.stdout
    # A stop string spanning two tokens ends the sequence after the token that completes it.
    stop = tokenizer.decode(sampled[1:3])
    cut = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=stop)).result().sequences[0]
    end = next(e for e in range(len(sampled) + 1) if stop in tokenizer.decode(sampled[:e]))
    assert (cut.tokens, cut.stop_reason) == (sampled[:end], "stop")


def test_a_custom_loss_on_the_client_trains_as_the_same_built_in_loss(service, base):
    """`forward_backward_custom`: the SDK takes `forward`'s logprobs, computes the loss and sends its
    gradient back; a custom weighted cross-entropy steps an adapter exactly as `cross_entropy` does."""
    client = _client(service)
    built_in, custom = (client.create_lora_training_client(base_model=base.name, rank=4, seed=7).result()
                        for _ in range(2))
    weights = np.array([0.0, 1.0, 0.5, 1.0], np.float32)
    data = [types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4, 5]),
                        loss_fn_inputs={"target_tokens": np.array([3, 4, 5, 6], np.int64), "weights": weights})]

    def weighted_nll(data, logprobs):
        pairs = zip(data, logprobs, strict=True)
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in pairs)
        return loss, {"custom_nll": float(loss)}

    for trainer, run in ((built_in, lambda t: t.forward_backward(data, "cross_entropy")),
                         (custom, lambda t: t.forward_backward_custom(data, weighted_nll))):
        for _ in range(2):
            run(trainer).result()
            trainer.optim_step(ADAM).result()
    np.testing.assert_allclose(_logprobs(custom, data)[0], _logprobs(built_in, data)[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(_logprobs(custom, data)[0], _logprobs(
        client.create_lora_training_client(base_model=base.name, rank=4, seed=7).result(), data)[0], atol=1e-3)


def test_the_cookbooks_sft_and_rl_data_train_unchanged(service, base):
    """tinker-cookbook's renderer, SFT datum and RL datum helpers, called as its recipes call them:
    per-example mean weights train, the sampler's logprobs are the trainer's, and an RL datum built
    from the service's own samples (with their provenance) takes an importance-sampling step."""
    from tinker_cookbook import renderers
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.rl.data_processing import assemble_training_data, compute_advantages
    from tinker_cookbook.rl.types import Trajectory, TrajectoryGroup, Transition
    from tinker_cookbook.supervised.common import compute_mean_nll, datum_from_model_input_weights

    client = _client(service)
    trainer = client.create_lora_training_client(base_model=base.name, rank=4).result()
    renderer = renderers.get_renderer("role_colon", trainer.get_tokenizer())
    chats = [[{"role": "user", "content": question}, {"role": "assistant", "content": "w9 w8 w7"}]
             for question in ("w3 w4 w5", "w20 w21", "w40 w41 w42 w43")]
    sft = [datum_from_model_input_weights(*renderer.build_supervised_example(chat), reduction="mean")
           for chat in chats]
    weights = [d.loss_fn_inputs["weights"] for d in sft]
    nll, adam = [], types.AdamParams(learning_rate=5e-3)
    for _ in range(8):
        out = trainer.forward_backward(sft, "cross_entropy").result()
        nll.append(compute_mean_nll([o["logprobs"] for o in out.loss_fn_outputs], weights))
        assert out.metrics["loss:sum"] == pytest.approx(nll[-1] * len(chats), rel=1e-5)  # each weighs 1
        trainer.optim_step(adam).result()
    assert nll[-1] < 0.5 * nll[0], nll

    sampler = trainer.save_weights_and_get_sampling_client().result()
    completer = TinkerTokenCompleter(sampler, max_tokens=4)
    prompt = renderer.build_generation_prompt(chats[0][:1])

    async def rollouts():
        return await asyncio.gather(*(completer(prompt, renderer.get_stop_sequences()) for _ in range(4)))

    actions = asyncio.run(rollouts())
    # Any reward that differs between samples: their surprise.
    group = TrajectoryGroup([Trajectory([Transition(prompt, action, -sum(action.logprobs), True)],
                                        final_ob=types.ModelInput.empty()) for action in actions],
                            final_rewards_G=[0.0] * 4, metrics_G=[{}] * 4)
    data, _ = assemble_training_data([group], compute_advantages([group]))
    assert all(d.model_input_spans for d in data)  # the samples' sequence ids travel with the data
    # As the cookbook's RL loop sends them: without the mask its metrics use.
    data = [dataclasses.replace(d, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "mask"})
            for d in data]
    out = trainer.forward_backward(data, "importance_sampling").result()
    loss = 0.0
    for datum, output, action in zip(data, out.loss_fn_outputs, actions, strict=True):
        lp, q = (np.asarray(x.tolist()) for x in (output["logprobs"], datum.loss_fn_inputs["logprobs"]))
        advantages = np.asarray(datum.loss_fn_inputs["advantages"].tolist())
        assert np.count_nonzero(advantages) == len(action.tokens)
        np.testing.assert_allclose(lp[-len(action.tokens):], action.logprobs, rtol=1e-4, atol=1e-4)
        loss -= float(np.sum(np.exp(lp - q) * advantages))
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    trainer.optim_step(ADAM).result()


def _paging(service, model_id: str) -> dict:
    return httpx.post(f"{service.url}/api/v1/get_info", json={"model_id": model_id},
                      headers={"X-API-Key": KEY}).json()["paging"]


def test_six_clients_in_turns_on_four_slots_train_save_load_and_sample_as_with_a_slot_each(service, paging_service,
                                                                                           base):
    """Six SDK clients, each training its own adapter in turns on a service with 4 device slots,
    get the losses, gradient norms, saved states and samples of the same clients on a service with
    8: every adapter is paged out and back between its steps."""
    data = [[_chat_datum(WORDS, f"w{3 + i} w{4 + i} w5", f"w{40 + i} w41 w42")] for i in range(6)]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    results = []
    for running in (service, paging_service):
        client = _client(running)
        trainers = [client.create_lora_training_client(base_model=base.name, rank=4 + 4 * (i % 2), seed=i).result()
                    for i in range(6)]
        seen = []
        for _ in range(3):
            for trainer, datum in zip(trainers, data, strict=True):
                seen.append(trainer.forward_backward(datum, "cross_entropy").result().metrics["loss:sum"])
                seen.append(trainer.optim_step(ADAM).result().metrics["grad_norm:mean"])
        path = trainers[0].save_state("paged").result().path
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        logprobs = [_logprobs(t, data[0]) for t in (trainers[0], resumed)]
        sampler = trainers[1].save_weights_and_get_sampling_client("paged-sampler")
        tokens = [s.tokens for s in sampler.sample(types.ModelInput.from_ints([2, 3, 4]), 2, params).result().sequences]
        results.append((seen, logprobs, tokens))
    assert results[0][0] == results[1][0]
    for whole, paged in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_array_equal(whole[0], paged[0])
    np.testing.assert_array_equal(results[1][1][0][0], results[1][1][1][0])  # the resumed state's logprobs
    assert results[0][2] == results[1][2]
    where = _paging(paging_service, trainers[0].model_id)
    assert where["page_ins"] > 0 and where["resident"] == 4, where


def test_eight_concurrent_clients_keep_64_adapters_alive_on_four_slots(paging_service, base):
    """8 clients at once, 8 adapters each: 64 alive on 4 device slots, at most 16 in host memory and
    the rest on disk; every request is answered and the host keeps no more than its 16 pages."""
    def one_client(i: int) -> list[float]:
        client = _client(paging_service)
        trainers = [client.create_lora_training_client(base_model=base.name, rank=4, seed=8 * i + j).result()
                    for j in range(8)]
        datum = [_chat_datum(WORDS, f"w{5 + i} w6 w7", f"w{50 + i} w51")]
        losses = []
        for _ in range(2):
            for trainer in trainers:
                losses.append(trainer.forward_backward(datum, "cross_entropy").result().metrics["loss:sum"])
                trainer.optim_step(ADAM).result()
        return losses, trainers[0].model_id

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(one_client, range(8)))
    assert all(len(losses) == 16 and all(np.isfinite(losses)) for losses, _ in done)
    where = _paging(paging_service, done[0][1])
    assert where["resident"] == 4 and where["host"] <= 16 and where["resident"] + where["host"] + where["disk"] == 64
    assert where["disk_writes"] > 0 and where["disk_reads"] > 0, where
    pages = list((paging_service.run_dir / "pages").glob("*/process-0.safetensors"))
    assert len(pages) == where["disk"]


def test_a_bad_request_is_one_clear_error_and_the_service_goes_on(service, base):
    client = _client(service)
    trainer = client.create_lora_training_client(base_model=base.name, rank=2).result()
    good = [types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4]),
                        loss_fn_inputs={"target_tokens": np.array([3, 4, 5], np.int64)})]
    oov = [types.Datum(model_input=types.ModelInput.from_ints([2, 300]),
                       loss_fn_inputs={"target_tokens": np.array([3, 4], np.int64)})]
    short = [types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4]),
                         loss_fn_inputs={"target_tokens": np.array([3, 4], np.int64)})]
    for data, match in ((oov, r"token ids must be in \[0, 128\)"), (short, "expected 3 values")):
        started = time.monotonic()
        with pytest.raises(tinker.BadRequestError, match=match):
            trainer.forward_backward(data, "cross_entropy").result()
        assert time.monotonic() - started < 10
    with pytest.raises(tinker.BadRequestError, match="rank: expected 1 to 8"):
        client.create_lora_training_client(base_model=base.name, rank=16).result()
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        client.create_lora_training_client(base_model="someone-else", rank=2).result()
    assert trainer.forward_backward(good, "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_restarted_service_gives_back_saved_state(tmp_path, base):
    """A stop saves the adapters of open sessions (no automatic saves here), which the restarted
    service brings back for the same client; a closed session's unsaved step is saved at its end;
    a checkpoint makes a new model with its next step."""
    run_dir = tmp_path / "runs" / "restart"
    first = Service(tmp_path, base, run_dir, "cluster.kind=none", "serve.autosave_every=0", name="first")
    client = _client(first)
    trainer = client.create_lora_training_client(base_model=base.name, rank=4).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4, 5]),
                        loss_fn_inputs={"target_tokens": np.array([3, 4, 5, 6], np.int64)})]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    path = trainer.save_state("kept").result().path
    want = _logprobs(trainer, data)
    trainer.forward_backward(data, "cross_entropy").result()
    next_step = trainer.optim_step(ADAM).result()
    live = tinker.ServiceClient(base_url=first.url, api_key=KEY)  # its session stays open across the restart
    kept = live.create_lora_training_client(base_model=base.name, rank=4, seed=3).result()
    for _ in range(2):
        kept.forward_backward(data, "cross_entropy").result()
        kept.optim_step(ADAM).result()
    kept_before = _logprobs(kept, data)
    _close_sessions(first)
    assert first.stop() == 0, first.output()
    assert "saved 1 adapters before the workers stop" in first.output()
    port = first.url.rsplit(":", 1)[1]
    second = Service(tmp_path, base, run_dir, "cluster.kind=none", f"serve.port={port}", name="second")
    try:
        for x, y in zip(kept_before, _logprobs(kept, data), strict=True):  # back as it was: no word of it
            np.testing.assert_array_equal(x, y)
        live.close("success").result(timeout=30)
        client = _client(second)
        rest = tinker.RestClient(base_url=second.url, api_key=KEY)
        listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
        # closing the first client's session saved its step after "kept"
        ended = f"tinker://{trainer.model_id}/weights/session-end-step-2"
        assert sorted(c.tinker_path for c in listed) == sorted([path, ended])
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        for x, y in zip(want, _logprobs(resumed, data), strict=True):
            np.testing.assert_array_equal(x, y)
        resumed.forward_backward(data, "cross_entropy").result()
        assert resumed.optim_step(ADAM).result().metrics == next_step.metrics
    finally:
        _close_sessions(second)
        assert second.stop() == 0, second.output()


STEP_DATA = [types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4, 5, 6]),
                         loss_fn_inputs={"target_tokens": np.array([3, 4, 5, 6, 7], np.int64)})]


def fb(trainer) -> float:
    """One forward_backward of `STEP_DATA`: its summed loss."""
    return trainer.forward_backward(STEP_DATA, "cross_entropy").result().metrics["loss:sum"]


def train(trainer, steps: int) -> list[float]:
    """`steps` of forward_backward then optim_step: each step's loss."""
    losses = []
    for _ in range(steps):
        losses.append(fb(trainer))
        trainer.optim_step(ADAM).result()
    return losses


@pytest.mark.ray
def test_two_local_hosts_give_the_one_process_losses_and_survive_a_kill_a_preemption_and_a_hang(tmp_path, base):
    """The default cluster kind over two hosts: an embedded Ray, the front end in the driver, the
    engine over both hosts' workers in lockstep, its adapters paged (2 device slots, 1 host page,
    the rest on disk, each host with its own shards); the same losses and seeded samples as the
    engine in one process with a slot for each.
    - A worker killed (-9) while the client is idle: the gang restarts, the adapter comes back from
      its automatic save at step 2 (its step 3 lost, which its next request is told), and its next
      steps equal those of the one-process run from step 2.
    - A preemption notice (SIGTERM) to a worker: the driver saves the adapter's unsaved step on the
      gang before it restarts, so the adapter comes back where it was and nothing is told.
    - A worker stopped (SIGSTOP) with a request in flight: a hang, blamed on the stopped rank; the
      request runs again on the new gang and gives the one-process loss."""

    def seeded_samples(trainer) -> list[list[int]]:
        sampler = trainer.save_weights_and_get_sampling_client("hosts")
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
        return [s.tokens for s in sampler.sample(types.ModelInput.from_ints([2, 3, 4]), 3, params).result().sequences]

    service = Service(tmp_path, base, tmp_path / "runs" / "none", "cluster.kind=none", name="none")
    try:
        trainer = _client(service).create_lora_training_client(base_model=base.name, rank=4, seed=1).result()
        expected = []
        for step in range(5):
            expected.append(fb(trainer))
            trainer.optim_step(ADAM).result()
            if step == 2:
                samples = seeded_samples(trainer)
    finally:
        _close_sessions(service)
        assert service.stop() == 0, service.output()

    run_dir = tmp_path / "runs" / "local"
    service = Service(tmp_path, base, run_dir, "cluster=local", "cluster.num_hosts=2", "cluster.devices_per_host=1",
                      "cluster.compile_timeout_s=240", "cluster.hang_timeout_s=45", "serve.autosave_every=2",
                      "serve.max_adapters=2", "serve.max_live_adapters=4", "serve.host_adapters=1", name="local")

    def worker(attempt: int, rank: int) -> int:
        path = run_dir / "logs" / f"attempt-{attempt}" / f"rank{rank}.pid"
        deadline = time.monotonic() + 240
        while f"attempt {attempt}: started" not in service.output() or not path.exists():
            assert time.monotonic() < deadline and service.proc.poll() is None, service.output()
            time.sleep(0.5)
        return int(path.read_text())

    try:
        client = _client(service)
        trainer = client.create_lora_training_client(base_model=base.name, rank=4, seed=1).result()
        others = [client.create_lora_training_client(base_model=base.name, rank=4, seed=s).result() for s in (2, 3)]
        losses = []
        for _ in range(3):  # the others' steps page the trainer out (2 device slots, 1 host page) and back
            losses += train(trainer, 1)
            for other in others:
                train(other, 1)
        np.testing.assert_allclose(losses, expected[:3], rtol=1e-5)
        assert seeded_samples(trainer) == samples  # every host samples the same tokens as one process
        paging = httpx.post(f"{service.url}/api/v1/get_info", json={"model_id": trainer.model_id},
                            headers={"X-API-Key": KEY}).json()["paging"]
        assert paging["disk_writes"] > 0 and paging["page_ins"] > 0, paging
        os.kill(worker(1, 1), signal.SIGKILL)
        # Told on its next request, or on the one in flight when the step found the worker gone.
        with pytest.raises(tinker.RequestFailedError, match="back from its last save, at step 2"):
            fb(trainer)
        again = [fb(trainer)]
        trainer.optim_step(ADAM).result()  # step 3, not saved automatically

        os.kill(worker(2, 0), signal.SIGTERM)
        worker(3, 0)
        again.append(fb(trainer))  # no notice: the adapter was saved at step 3 before the gang stopped
        trainer.optim_step(ADAM).result()
        deadline = time.monotonic() + 60
        while httpx.post(f"{service.url}/api/v1/get_info", json={"model_id": trainer.model_id},
                         headers={"X-API-Key": KEY}).json()["saved_step"] != 4:  # the automatic save of step 4
            assert time.monotonic() < deadline
            time.sleep(0.2)

        os.kill(worker(3, 1), signal.SIGSTOP)
        again.append(fb(trainer))  # in flight until the hang is found; run again on the next gang
        np.testing.assert_allclose(again, expected[2:], rtol=1e-5)
    finally:
        _close_sessions(service)
        code = service.stop()
    output = service.output()
    assert code == 0, output
    assert "attempt 1: started 2 worker processes" in output and "attempt 1 ended: crash (rank 1)" in output
    assert "rank 0 received a preemption notice: saving the adapters" in output
    assert "attempt 2 ended: preempted (rank 0)" in output
    assert "attempt 3 ended: hang (rank 1): rank 1's process is stopped" in output


@pytest.mark.ray
def test_a_service_on_a_fake_tpu_slice_runs_its_engine_over_the_slices_hosts(tmp_path, base, monkeypatch):
    """`cluster=tpu`: the driver reserves a whole v4-16 slice (2 hosts) and its workers reach the
    step channel at the Ray node's address, not loopback; the adapter trains over both hosts."""
    with fake_tpu_slices(tmp_path, monkeypatch, 1) as cluster:
        run_dir = tmp_path / "runs" / "tpu"
        service = Service(tmp_path, base, run_dir, *on_tpu(cluster), name="tpu")
        try:
            trainer = _client(service).create_lora_training_client(base_model=base.name, rank=4, seed=1).result()
            losses = train(trainer, 3)
            assert losses[2] < losses[0]
        finally:
            _close_sessions(service)
            code = service.stop()
    output = service.output()
    assert code == 0, output
    assert "reserved 2 hosts" in output and "attempt 1: started 2 worker processes" in output
    logs = [(run_dir / "logs" / "attempt-1" / f"rank{r}.log").read_text() for r in range(2)]
    assert all(f"process {r} of 2, 2 local of 4 cpu devices" in log for r, log in enumerate(logs)), logs[0][-2000:]
