"""The service's engine on one process: many adapters' rows in one step, each getting what its
adapter alone would give; an Adam step of one adapter leaves the others bit-identical and equals
optax's AdamW on that adapter alone; sampling and saved state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from serve_fixtures import ADAM, TARGETS, make_engine, padded, reference_loss, reference_losses, sft_datum, single

from podtrain.models.generate import generate
from podtrain.models.lora import LoRAParam, adapters, slot_view
from podtrain.orchestrator.serve.work import (
    Create,
    ForwardBackward,
    ForwardBackwardResult,
    Load,
    OptimStep,
    OptimStepResult,
    Sample,
    Save,
    ServeError,
    Unload,
)

# Every test here compiles the engine's programs: make test-quick leaves them to make test.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def _flat(model):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}


def test_rows_of_many_adapters_in_one_step_get_their_own_results_and_steps(engine):
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(0)
    engine.run([Create("a", 4, TARGETS, seed=1), Create("b", 8, ("gate_proj", "up_proj", "down_proj"), seed=2)])
    # Train b a little so that its adapter is not new (B no longer zero).
    warm = tuple(sft_datum(rng, 12, vocab) for _ in range(2))
    engine.run([ForwardBackward("b", warm, "cross_entropy"), OptimStep("b", ADAM)])
    data_a = tuple(sft_datum(rng, n, vocab) for n in (9, 20, 5))
    data_b = tuple(sft_datum(rng, n, vocab) for n in (17,))
    before_a, before_b = single(engine, "a"), single(engine, "b")
    params_b = _flat(before_b)
    out = engine.run([ForwardBackward("a", data_a, "cross_entropy"), ForwardBackward("b", data_b, "cross_entropy")])
    assert isinstance(out[0], ForwardBackwardResult), out[0]
    for result, model, data in ((out[0], before_a, data_a), (out[1], before_b, data_b)):
        lps, total = reference_losses(model, data)
        for got, want in zip(result.outputs, lps, strict=True):
            np.testing.assert_allclose(got["logprobs"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.metrics["loss:sum"], total, rtol=1e-5)
    # a's pending gradient is that of its rows on a alone.
    graphdef, params, rest = nnx.split(before_a, LoRAParam, ...)
    want_grads = jax.jit(jax.grad(lambda p, *arrays: reference_loss(nnx.merge(graphdef, p, rest), *arrays)))(
        params, *padded(data_a))
    slot = engine.loaded["a"]
    pending = slot_view(nnx.merge(engine.graphdef, engine.grads, engine.rest), slot.index, slot.rank,
                        engine.config.serve.lora_alpha, slot.targets)
    got_grads = _flat(pending)
    for key, want in ((k, np.asarray(v.get_value())) for k, v in nnx.to_flat_state(want_grads)):
        np.testing.assert_allclose(got_grads[key], want, rtol=1e-4, atol=2e-5 * np.abs(want).max(), err_msg=str(key))
    # a's step is optax's AdamW on that gradient, clipped by a's own gradient norm.
    step = engine.run([OptimStep("a", ADAM)])[0]
    grads = nnx.state(pending, LoRAParam)
    tx = optax.chain(optax.clip_by_global_norm(ADAM["grad_clip_norm"]),
                     optax.adamw(ADAM["learning_rate"], ADAM["beta1"], ADAM["beta2"], ADAM["eps"],
                                 weight_decay=ADAM["weight_decay"]))
    updates, _ = tx.update(grads, tx.init(params), params)
    want = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(optax.apply_updates(params, updates))}
    got = _flat(single(engine, "a"))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-8, err_msg=str(key))
    assert step.metrics["grad_norm:mean"] > ADAM["grad_clip_norm"]  # the clip was used
    # b had no step: bit-identical; its pending gradient is applied by its next step.
    for key, value in _flat(single(engine, "b")).items():
        np.testing.assert_array_equal(value, params_b[key])
    engine.run([Unload("a"), Unload("b")])


def test_sampling_rows_of_several_adapters(engine, tmp_path):
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(1)
    engine.run([Create("s", 8, TARGETS, seed=3), Create("t", 2, TARGETS, seed=4)])
    engine.run([ForwardBackward(m, tuple(sft_datum(rng, 10, vocab) for _ in range(2)), "cross_entropy")
                for m in ("s", "t")] + [OptimStep("s", ADAM), OptimStep("t", ADAM)])
    prompt_s, prompt_t = rng.integers(0, vocab, 7).astype(np.int32), rng.integers(0, vocab, 12).astype(np.int32)
    out = engine.run([Sample("s", prompt_s, max_tokens=9, temperature=0.0, prompt_logprobs=True),
                      Sample("t", prompt_t, max_tokens=5, temperature=0.0),
                      Sample("s", prompt_s, num_samples=2, max_tokens=6, temperature=1.0, top_k=20, top_p=0.9,
                             seed=11),
                      Sample("s", prompt_s, num_samples=2, max_tokens=6, temperature=1.0, top_k=20, top_p=0.9,
                             seed=11)])
    for result, model_id, prompt, n in ((out[0], "s", prompt_s, 9), (out[1], "t", prompt_t, 5)):
        want = generate(single(engine, model_id), [prompt.tolist()], max_new_tokens=n)[0]
        assert result.sequences[0].tokens.tolist() == want
        assert result.sequences[0].stop_reason == "length"
    # Prompt logprobs are the model's; the sampled tokens' logprobs are too (greedy).
    logits = single(engine, "s")(jnp.asarray(np.concatenate([prompt_s, out[0].sequences[0].tokens]))[None])[0][0]
    lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
    full = np.concatenate([prompt_s, out[0].sequences[0].tokens])
    np.testing.assert_allclose(out[0].prompt_logprobs[1:], lp[np.arange(6), full[1:7]], rtol=1e-4, atol=1e-4)
    assert np.isnan(out[0].prompt_logprobs[0])
    np.testing.assert_allclose(out[0].sequences[0].logprobs, lp[np.arange(6, 15), full[7:16]], rtol=1e-4, atol=1e-4)
    # A seeded sampler repeats itself; its two samples differ from each other.
    assert [s.tokens.tolist() for s in out[2].sequences] == [s.tokens.tolist() for s in out[3].sequences]
    assert out[2].sequences[0].tokens.tolist() != out[2].sequences[1].tokens.tolist()
    # A stop token ends a sequence, included.
    stop = int(out[0].sequences[0].tokens[3])
    stopped = engine.run([Sample("s", prompt_s, max_tokens=9, temperature=0.0, stop_tokens=(stop,))])[0]
    first = out[0].sequences[0].tokens.tolist().index(stop)
    assert stopped.sequences[0].tokens.tolist() == out[0].sequences[0].tokens.tolist()[:first + 1]
    assert stopped.sequences[0].stop_reason == "stop"
    # So does a stop string's token sequence, after its last token.
    greedy = out[0].sequences[0].tokens.tolist()
    pair = tuple(greedy[4:6])
    stopped = engine.run([Sample("s", prompt_s, max_tokens=9, temperature=0.0, stop_sequences=(pair,))])[0]
    end = next(i for i in range(2, len(greedy) + 1) if tuple(greedy[i - 2:i]) == pair)
    assert (stopped.sequences[0].tokens.tolist(), stopped.sequences[0].stop_reason) == (greedy[:end], "stop")
    engine.run([Unload("s"), Unload("t")])


def test_saved_state_comes_back_with_the_same_logprobs_and_next_step(engine, tmp_path):
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(2)
    data = tuple(sft_datum(rng, 11, vocab) for _ in range(2))
    engine.run([Create("x", 4, TARGETS, seed=5), ForwardBackward("x", data, "cross_entropy"), OptimStep("x", ADAM)])
    engine.run([Save("x", str(tmp_path / "x"), optimizer=True), Save("x", str(tmp_path / "xs"), optimizer=False)])
    assert (tmp_path / "xs" / "adapter_config.json").exists()
    engine.run([Load("y", str(tmp_path / "x"), optimizer=True)])
    out = engine.run([ForwardBackward("x", data, "cross_entropy"), ForwardBackward("y", data, "cross_entropy"),
                      OptimStep("x", ADAM), OptimStep("y", ADAM)])
    for a, b in zip(out[0].outputs, out[1].outputs, strict=True):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
    x, y = _flat(single(engine, "x")), _flat(single(engine, "y"))
    for key in x:
        np.testing.assert_array_equal(x[key], y[key])
    with pytest.raises(AssertionError):  # weights only: no optimizer state to load
        assert not isinstance(engine.run([Load("z", str(tmp_path / "xs"), optimizer=True)])[0], ServeError)
    engine.run([Unload("x"), Unload("y")])


def test_a_save_stopped_between_its_renames_leaves_the_previous_save_loadable(engine, tmp_path, monkeypatch):
    """A save writes the new state beside the old and swaps them: killed before the new one is in
    place, the old one is still there to load, and the next save completes the swap."""
    import os

    vocab = engine.info().vocab_size
    rng = np.random.default_rng(9)
    data = tuple(sft_datum(rng, 9, vocab) for _ in range(2))
    path = tmp_path / "state"
    engine.run([Create("s", 2, TARGETS, seed=4), Save("s", str(path), optimizer=True),
                ForwardBackward("s", data, "cross_entropy"), OptimStep("s", ADAM)])
    replace = os.replace

    def killed_before_the_new_is_in_place(src, dst):
        if str(src).endswith(".partial"):
            raise SystemExit("killed")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_new_is_in_place)
    with pytest.raises(SystemExit):
        engine.run([Save("s", str(path), optimizer=True)])
    monkeypatch.setattr(os, "replace", replace)
    loaded = engine.run([Load("back", str(path), optimizer=True)])[0]
    assert loaded.steps == 0  # the first save, whole
    engine.run([Save("s", str(path), optimizer=True)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    assert engine.run([Load("again", str(path), optimizer=True)])[0].steps == 1
    engine.run([Unload("s"), Unload("back"), Unload("again")])


def test_bad_items_are_refused_alone(engine):
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(3)
    good = sft_datum(rng, 6, vocab)
    oov = sft_datum(rng, 6, vocab)
    oov.tokens[2] = vocab
    short = type(good)(good.tokens, {"target_tokens": good.inputs["target_tokens"][:-1]})
    for work, match in [(Create("q", 9, TARGETS), "rank: expected 1 to 8"),
                        (ForwardBackward("q", (oov,), "cross_entropy"), r"token ids must be in \[0, "),
                        (ForwardBackward("q", (short,), "cross_entropy"), "expected 6 values"),
                        (ForwardBackward("q", (good,), "nope"), "loss_fn: expected one of"),
                        (ForwardBackward("q", (good,), "ppo"), "missing"),
                        (ForwardBackward("q", (sft_datum(rng, 70, vocab),), "cross_entropy"), "serve.max_seq_len"),
                        (Sample(None, good.tokens, max_tokens=60), "serve.max_sample_tokens")]:
        with pytest.raises(ServeError, match=match):
            engine.check(work)
    engine.run([Create("q", 2, TARGETS)])
    out = engine.run([ForwardBackward("q", (good,), "cross_entropy"),
                      ForwardBackward("nobody", (good,), "cross_entropy"), Create("q", 2, TARGETS)])
    assert isinstance(out[0], ForwardBackwardResult)
    assert isinstance(out[1], ServeError) and out[1].status == 404
    assert isinstance(out[2], ServeError) and "already exists" in str(out[2])
    full = engine.run([Create(f"f{i}", 2, TARGETS) for i in range(4)])
    assert isinstance(full[-1], ServeError) and full[-1].status == 429 and "no free adapter slot" in str(full[-1])
    engine.run([Unload(m) for m in ("q", "f0", "f1", "f2")])


def test_a_request_that_breaks_the_engine_fails_alone_and_the_others_get_their_results(engine, monkeypatch):
    """An error that is not a refusal (a bug a request's data brings out, here injected) fails that
    request alone: its step's other rows, and the call's other items, get what they would without it."""
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(7)
    engine.run([Create("ok", 2, TARGETS, seed=1), Create("bad", 2, TARGETS, seed=2)])
    data = tuple(sft_datum(rng, n, vocab) for n in (7, 11))
    model = single(engine, "ok")
    passes = engine._passes

    def breaks_on_bad(works, group, results):
        if any(works[i].model_id == "bad" for i in group):
            raise RuntimeError("boom")
        return passes(works, group, results)

    monkeypatch.setattr(engine, "_passes", breaks_on_bad)
    out = engine.run([ForwardBackward("ok", data, "cross_entropy"), ForwardBackward("bad", data, "cross_entropy"),
                      OptimStep("ok", ADAM), OptimStep("bad", ADAM)])
    assert isinstance(out[1], ServeError) and out[1].status == 500 and str(out[1]).endswith("RuntimeError: boom")
    lps, total = reference_losses(model, data)
    for got, want in zip(out[0].outputs, lps, strict=True):
        np.testing.assert_allclose(got["logprobs"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[0].metrics["loss:sum"], total, rtol=1e-5)
    assert isinstance(out[2], OptimStepResult) and isinstance(out[3], OptimStepResult)
    assert out[2].metrics["grad_norm:mean"] > 0 and out[3].metrics["grad_norm:mean"] == 0  # bad had no gradient
    engine.run([Unload("ok"), Unload("bad")])


def test_steady_work_of_other_lengths_and_adapters_does_not_recompile(engine):
    from podtrain.orchestrator.serve.programs import adam_steps, forward_backward

    vocab = engine.info().vocab_size
    rng = np.random.default_rng(4)
    engine.run([Create("u", 4, TARGETS, seed=1), Create("v", 2, TARGETS, seed=2)])

    def step(lengths_u, lengths_v):
        engine.run([ForwardBackward("u", tuple(sft_datum(rng, n, vocab) for n in lengths_u), "cross_entropy"),
                    ForwardBackward("v", tuple(sft_datum(rng, n, vocab) for n in lengths_v), "cross_entropy"),
                    OptimStep("u", ADAM), OptimStep("v", ADAM)])

    step((20, 30), (17,))  # 3 rows of at most 32 tokens: padded to 4 x 32
    compiled = forward_backward._cache_size(), adam_steps._cache_size()
    step((25,), (18, 31, 19))  # other lengths, adapters and rows: the same padded shape
    step((32, 17, 20), ())
    assert (forward_backward._cache_size(), adam_steps._cache_size()) == compiled
    engine.run([Unload("u"), Unload("v")])


def test_a_sharded_engine_gives_the_one_device_results(engine):
    """fsdp=2 over 2 devices and fsdp x tp over 4: the same logprobs, losses, steps and samples as
    on one device. Every slot array, its gradient and its moments are split over fsdp (ZeRO): no
    half of an adapter is whole on every device."""
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(5)
    data = {m: tuple(sft_datum(rng, n, vocab) for n in lengths) for m, lengths in (("g", (9, 14)), ("h", (21,)))}
    prompt = rng.integers(0, vocab, 6).astype(np.int32)
    engines = [engine, make_engine(devices=2, overrides=("mesh.fsdp=2",)),
               make_engine(devices=4, overrides=("mesh.fsdp=2", "mesh.tp=2"))]
    outs = []
    for e in engines:
        e.run([Create("g", 4, TARGETS, seed=1), Create("h", 8, ("gate_proj", "up_proj", "down_proj"), seed=2)])
        e.run([ForwardBackward(m, d, "cross_entropy") for m, d in data.items()] + [OptimStep("g", ADAM),
                                                                                   OptimStep("h", ADAM)])
        outs.append(e.run([ForwardBackward(m, d, "cross_entropy", backward=False) for m, d in data.items()]
                          + [Sample("g", prompt, max_tokens=6, temperature=0.0)]))
        e.run([Unload("g"), Unload("h")])
    specs = [str(leaf.sharding.spec) for leaf in jax.tree.leaves(engines[2].adapters)]
    assert any("'tp'" in spec for spec in specs), specs
    for e in engines[1:]:
        for leaf in jax.tree.leaves((e.adapters, e.grads, e.adam.mu, e.adam.nu)):
            assert "'fsdp'" in str(leaf.sharding.spec), (leaf.shape, leaf.sharding.spec)
    for out in outs[1:]:
        for one, many in zip(outs[0][:2], out[:2], strict=True):
            for a, b in zip(one.outputs, many.outputs, strict=True):
                np.testing.assert_allclose(b["logprobs"], a["logprobs"], rtol=1e-5, atol=1e-5)
        assert out[2].sequences[0].tokens.tolist() == outs[0][2].sequences[0].tokens.tolist()


def test_deepseek_v3_with_expert_parallel_experts_trains_and_samples_its_adapters():
    """MLA and MoE layers, experts over ep=2 with adapters, the LM head tied to the embedding: two
    adapters train in one step, and their logprobs and greedy sampling equal those of the adapter
    alone."""
    from podtrain.orchestrator.serve.checks import serve_targets
    from podtrain.sharding.rules import use_rules

    deepseek = make_engine("deepseek-v3-tiny", devices=4,
                           overrides=("mesh.ep=2", "mesh.fsdp=2", "model.tie_word_embeddings=true"))
    targets = serve_targets("deepseek_v3")
    assert "lm_head" in targets and "experts" in targets
    rng = np.random.default_rng(6)
    vocab = deepseek.info().vocab_size
    data = tuple(sft_datum(rng, 12, vocab) for _ in range(2))
    deepseek.run([Create("a", 4, targets, seed=1), Create("b", 8, ("gate_proj", "up_proj", "down_proj"), seed=2)])
    before = deepseek.run([ForwardBackward("a", data, "cross_entropy")])[0].metrics["loss:sum"]
    deepseek.run([ForwardBackward("b", data, "cross_entropy"), OptimStep("a", ADAM), OptimStep("b", ADAM)])
    out = deepseek.run([ForwardBackward("a", data, "cross_entropy", backward=False)])[0]
    assert out.metrics["loss:sum"] < before
    trained = dict(adapters(single(deepseek, "a")))
    assert any(key.endswith("w_down") and np.asarray(a.lora_b[...]).any() for key, a in trained.items())
    with jax.sharding.set_mesh(deepseek.mesh), use_rules(deepseek.rules):
        want, _ = reference_losses(single(deepseek, "a"), data)
    for got, lp in zip(out.outputs, want, strict=True):
        np.testing.assert_allclose(got["logprobs"], lp, rtol=1e-4, atol=1e-4)
    prompt = rng.integers(0, vocab, 5).astype(np.int32)
    sampled = deepseek.run([Sample("a", prompt, max_tokens=5, temperature=0.0)])[0].sequences[0].tokens.tolist()
    with jax.sharding.set_mesh(deepseek.mesh), use_rules(deepseek.rules):
        assert sampled == generate(single(deepseek, "a"), [prompt.tolist()], max_new_tokens=5)[0]


def test_steps_of_several_adapters_in_one_call_are_each_their_own(engine):
    """Two adapters stepped in one program, each with its own AdamParams, end exactly where each
    stepped alone ends."""
    vocab = engine.info().vocab_size
    rng = np.random.default_rng(7)
    data = tuple(sft_datum(rng, 10, vocab) for _ in range(2))
    slow = dict(ADAM, learning_rate=1e-3, grad_clip_norm=0.0)
    pairs = (("p1", "q1"), ("p2", "q2"))
    # p1 and p2 are the same new adapter (seed 0), as are q1 and q2 (seed 1).
    engine.run([Create(m, 4, TARGETS, seed=i % 2) for i, m in enumerate(m for pair in pairs for m in pair)])
    engine.run([ForwardBackward(m, data, "cross_entropy") for pair in pairs for m in pair])
    engine.run([OptimStep("p1", ADAM), OptimStep("q1", slow)])  # together
    engine.run([OptimStep("p2", ADAM)])  # one at a time
    engine.run([OptimStep("q2", slow)])
    for a, b in (("p1", "p2"), ("q1", "q2")):
        x, y = _flat(single(engine, a)), _flat(single(engine, b))
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"{a} {key}")
    assert any(not np.array_equal(_flat(single(engine, "p1"))[k], _flat(single(engine, "q1"))[k])
               for k in _flat(single(engine, "p1")))
    engine.run([Unload(m) for pair in pairs for m in pair])


def test_a_new_row_count_does_not_stop_to_compile():
    """`serve.compile_ahead`: a token count's first batch (1 row) has its other row counts compiled
    in the background while other work runs; batches of 3 and 8 rows then compile nothing and give
    the adapter's own logprobs."""
    ahead = make_engine(overrides=("serve.compile_ahead=true",))
    vocab = ahead.info().vocab_size
    rng = np.random.default_rng(8)
    ahead.run([Create("w", 4, TARGETS, seed=1)])
    ahead.run([ForwardBackward("w", (sft_datum(rng, 40, vocab),), "cross_entropy"), OptimStep("w", ADAM)])  # 1 x 64
    ahead.run([Sample("w", rng.integers(0, vocab, 5).astype(np.int32), max_tokens=3, temperature=0.0)])
    ahead._warmer.wait()
    compiles = []  # XLA compiles (or loads from the compilation cache) of the step

    def on_compile(event, _, fun_name="", **__):
        if event == "/jax/core/compile/backend_compile_duration" and "forward_backward" in fun_name:
            compiles.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        batches = [tuple(sft_datum(rng, n, vocab) for n in (40, 50, 60)),
                   tuple(sft_datum(rng, 45, vocab) for _ in range(8))]
        outs = [ahead.run([ForwardBackward("w", data, "cross_entropy", backward=False)])[0] for data in batches]
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert compiles == []
    for data, out in zip(batches, outs, strict=True):
        for got, want in zip(out.outputs, reference_losses(single(ahead, "w"), data)[0], strict=True):
            np.testing.assert_allclose(got["logprobs"], want, rtol=1e-4, atol=1e-4)
