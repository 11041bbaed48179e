"""How `plan --serve` walks from its estimate to the adapter count where the compiler draws the
line, with the compiles replaced by peaks that grow as measured ones do (about linearly, a little
faster or slower at larger counts, or with a jump): few compiles near the estimate, and the
boundary found when the estimate is far off."""

import types

import pytest

from podtrain.orchestrator.plan import serve_plan

GIB = 2**30


def _linear(n):
    return 16 * GIB - (77 - n) * 0.2 * GIB  # 77 adapters meet the memory


@pytest.mark.parametrize("peak, most_compiles", [
    (_linear, 4),                                                     # the estimate is the boundary
    (lambda n: _linear(n) + 0.002 * GIB * (n - 8) * (n - 16), 6),     # growing faster than the first two say
    (lambda n: _linear(n) - 0.05 * GIB * max(0, n - 16), 6),          # growing slower
    (lambda n: _linear(n) + (6 * GIB if n > 40 else 0), 8),           # a jump far below the estimate
    (lambda n: _linear(n) + 20 * GIB, 3),                             # not even one fits
])
def test_the_search_ends_where_one_count_fits_and_the_next_does_not(monkeypatch, peak, most_compiles):
    hbm = 16 * GIB
    boundary = max((n for n in range(1, 1000) if peak(n) <= hbm), default=0)
    compiled = []

    def plan(config, target, devices, programs):
        n = config.serve.max_adapters
        compiled.append(n)
        bytes_ = int(peak(n))
        return {"fits": bytes_ <= hbm, "peak_bytes": bytes_, "hbm_bytes": hbm,
                "programs": dict.fromkeys(programs, {"peak_bytes": bytes_}),
                "host": {"page_capacity": 500, "page_bytes": GIB}}

    monkeypatch.setattr(serve_plan, "plan_serve_on_target", plan)
    monkeypatch.setattr(serve_plan, "apply_overrides", lambda config, overrides, serving: types.SimpleNamespace(
        serve=types.SimpleNamespace(max_adapters=int(overrides[0].split("=")[1]))))
    target = types.SimpleNamespace(chip=types.SimpleNamespace(hbm_bytes=hbm))
    config = types.SimpleNamespace(serve=types.SimpleNamespace(max_adapters=8))
    fit = serve_plan.adapters_that_fit(config, target, devices=[], max_compiles=14)  # the first count counts
    assert fit["max_adapters"] == boundary and fit["checked"], (fit, compiled)
    assert fit["max_live_adapters"] == boundary + 500  # the host's pages beside the slots
    assert fit["compiles"] == len(compiled) <= most_compiles, compiled
