"""How `plan --serve` walks from its estimate to the adapter count where the compiler draws the
line, with the compiles replaced by a rule: few compiles near the estimate, and the boundary
found when the estimate is far off."""

import types

import pytest

from podtrain.orchestrator.plan import serve_plan

GIB = 2**30


@pytest.mark.parametrize("boundary, most_compiles", [
    (77, 4),    # the estimate is the boundary: it fits, one more does not
    (78, 5),    # one above the estimate
    (75, 5),    # two below the estimate: no more compiles than steps of one
    (100, 13),  # far above: steps doubling upwards, then halving
    (40, 14),   # far below: steps doubling downwards, then halving
    (0, 8),     # not even one fits
])
def test_the_search_ends_where_one_count_fits_and_the_next_does_not(monkeypatch, boundary, most_compiles):
    hbm = 16 * GIB
    compiled = []

    def plan(config, target, devices, programs):
        n = config.serve.max_adapters
        compiled.append(n)
        # Linear bytes that put the estimate at 77 adapters; the rule, not the bytes, says what fits.
        peak = int(hbm - (77 - n) * 0.2 * GIB)
        return {"fits": n <= boundary, "peak_bytes": peak, "programs": dict.fromkeys(programs, {"peak_bytes": peak})}

    monkeypatch.setattr(serve_plan, "plan_serve_on_target", plan)
    monkeypatch.setattr(serve_plan, "apply_overrides", lambda config, overrides, serving: types.SimpleNamespace(
        serve=types.SimpleNamespace(max_adapters=int(overrides[0].split("=")[1]))))
    target = types.SimpleNamespace(chip=types.SimpleNamespace(hbm_bytes=hbm))
    config = types.SimpleNamespace(serve=types.SimpleNamespace(max_adapters=8))
    fit = serve_plan.adapters_that_fit(config, target, devices=[], max_compiles=14)  # the first count counts
    assert fit["max_adapters"] == boundary and fit["checked"], fit
    assert fit["compiles"] == len(compiled) <= most_compiles, compiled
