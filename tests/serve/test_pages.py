"""The paged adapter table (`serve/pages.py`) in one engine process: more adapters alive than
device slots, waiting in host memory and on disk, with the same results as slots for all."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from serve_fixtures import ADAM, TARGETS, make_engine, sft_datum

from podtrain.orchestrator.serve.work import Create, ForwardBackward, Load, OptimStep, Sample, Save, ServeError, Unload

pytestmark = pytest.mark.slow
NAMES = [f"m{i}" for i in range(6)]


def _train(engine, data, rounds=3):
    """Each adapter's pass in turn, then the even adapters' steps, then the odd ones', whose
    gradients wait while the others take the slots. Returns every pass's loss."""
    losses = []
    for _ in range(rounds):
        losses += [engine.run([ForwardBackward(m, data[m], "cross_entropy")])[0].metrics["loss:sum"] for m in NAMES]
        norms = engine.run([OptimStep(m, ADAM) for m in NAMES[::2]])
        norms += [engine.run([OptimStep(m, ADAM)])[0] for m in NAMES[1::2]]
        losses += [r.metrics["grad_norm:mean"] for r in norms]
    return losses


def test_paged_adapters_train_save_load_and_sample_as_with_a_slot_each(tmp_path):
    """2 device slots, room for 2 adapters in host memory, the rest on disk: six adapters' losses,
    gradient norms, samples and saved states are those of an engine with a slot for each, bit for
    bit, and a paged adapter saves, loads and samples. (Over two devices, with each process
    keeping its own shards: `test_service.py`, whose service runs without the compilation cache
    that deadlocks a two-device engine in one process on CPU.)"""
    pages = tmp_path / "pages"
    paged = make_engine(page_dir=pages, overrides=("serve.max_adapters=2", "serve.max_live_adapters=8",
                                                   "serve.host_adapters=2"))
    whole = make_engine(overrides=("serve.max_adapters=8",))
    vocab = whole.info().vocab_size
    rng = np.random.default_rng(0)
    data = {m: tuple(sft_datum(rng, 10 + i, vocab) for _ in range(2)) for i, m in enumerate(NAMES)}
    results = {}
    for name, engine in (("paged", paged), ("whole", whole)):
        engine.run([Create(m, 4 if i % 2 else 8, TARGETS, seed=i) for i, m in enumerate(NAMES)])
        losses = _train(engine, data)
        engine.run([ForwardBackward("m1", data["m1"], "cross_entropy")])  # m1's gradient pending, paged out
        engine.run([ForwardBackward(m, data[m], "cross_entropy", backward=False) for m in NAMES[2:]])
        engine.run([Save("m1", str(tmp_path / name / "m1"), optimizer=True)])
        engine.run([OptimStep("m1", ADAM)])
        sample = engine.run([Sample("m3", data["m3"][0].tokens[:5], max_tokens=6, temperature=0.0)])[0]
        engine.run([Load("copy", str(tmp_path / name / "m1"), optimizer=True)] + [
            ForwardBackward(m, data["m1"], "cross_entropy", backward=False) for m in ("m1", "copy")])
        after = engine.run([ForwardBackward(m, data["m1"], "cross_entropy", backward=False)
                            for m in ("m1", "copy")])
        results[name] = (losses, sample.sequences[0].tokens.tolist(), [r.outputs[0]["logprobs"] for r in after])
    assert results["paged"][0] == results["whole"][0]
    assert results["paged"][1] == results["whole"][1]
    for a, b in zip(results["paged"][2], results["whole"][2], strict=True):
        np.testing.assert_array_equal(a, b)
    saved = [load_file(str(tmp_path / name / "m1" / "adapter.safetensors")) for name in ("paged", "whole")]
    assert saved[0].keys() == saved[1].keys()
    for key in saved[0]:
        np.testing.assert_array_equal(saved[0][key], saved[1][key], err_msg=key)

    where = paged.paging()
    assert (where["resident"], where["host"], where["disk"]) == (2, 2, 3)
    assert where["disk_writes"] > 0 and where["disk_reads"] > 0 and where["page_ins"] > 0
    assert json.loads((pages / "paging.json").read_text())["disk"] == 3
    on_disk = sorted(p.parent.name for p in pages.glob("*/process-0.safetensors"))
    assert len(on_disk) == 3
    assert whole.paging()["page_outs"] == 0


def test_live_adapters_are_capped_and_an_unloaded_page_is_forgotten(tmp_path):
    pages = tmp_path / "pages"
    engine = make_engine(page_dir=pages, overrides=("serve.max_adapters=1", "serve.max_live_adapters=3",
                                                     "serve.host_adapters=1"))
    engine.run([Create(m, 4, TARGETS, seed=i) for i, m in enumerate(("a", "b", "c"))])
    assert (engine.paging()["resident"], engine.paging()["host"], engine.paging()["disk"]) == (1, 1, 1)
    refused = engine.run([Create("d", 4, TARGETS, seed=3)])[0]
    assert isinstance(refused, ServeError) and refused.status == 429
    assert "all 3 (serve.max_live_adapters)" in str(refused)
    (on_disk,) = [p.parent for p in pages.glob("*/process-0.safetensors")]
    assert on_disk.name == "a"  # the least recently used
    engine.run([Unload("a"), Unload("b")])
    assert not list(pages.glob("*/process-0.safetensors"))
    assert (engine.paging()["resident"], engine.paging()["host"], engine.paging()["disk"]) == (1, 0, 0)
    engine.run([Create("d", 4, TARGETS, seed=3), Create("e", 4, TARGETS, seed=4)])
    assert len(engine.loaded) == 3
