"""`podtrain plan --serve --target`: the service's engine compiled for a TPU slice, and how many
adapters fit, as the TPU compiler draws the line. The plans run as the CLI does, in a child process
without the tests' CPU compile flags."""

import json

import pytest
from test_plan_target import needs_tpu, podtrain

pytestmark = pytest.mark.slow
# Rank 1024 adapters on every target of llama3-tiny (its 128k vocabulary makes the head's adapters
# large): some tens fit a v5e chip's 16 GiB.
SMALL = ["serve.max_rank=1024", "serve.max_seq_len=64", "serve.max_rows=4"]


def serve_plan(target, *overrides, code=0):
    done = podtrain("plan", "-c", "llama3-tiny", "--serve", "--target", target, "--json", *overrides)
    assert done.returncode == code, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_tpu
def test_the_adapters_that_fit_are_where_the_compiler_accepts_the_engine_and_refuses_one_more():
    report = serve_plan("v5e-4", "serve.max_adapters=8", *SMALL)
    assert report["fits"] and report["checked_by"] == "the TPU compiler" and report["mesh"]["fsdp"] == 4
    assert set(report["programs"]) == {"forward_backward", "adam_steps", "sample"}
    # Every program takes the whole engine: base, adapters and their gradients, and the Adam state.
    held = report["base_bytes"] + 2 * report["adapters_bytes"] + report["adam_bytes"]
    assert all(p["peak_bytes"] >= held for p in report["programs"].values())
    assert report["programs"]["forward_backward"]["collective_bytes_per_token"] > 0  # fsdp=4 gathers
    # Host RAM: an adapter's save gathers one slot's weights and both Adam moments (three times its
    # weights) on every host, and their file's bytes; the base's import one parameter's shards.
    host = report["host"]
    assert host["ram_bytes"] == 192 * 2**30 and host["fits"]
    assert host["phases"]["adapter save"] >= 2 * 3 * report["adapters_bytes"] // 8
    fit = report["adapters_that_fit"]
    n = fit["max_adapters"]
    assert fit["checked"] and fit["fits_at"][str(n)] and not fit["fits_at"][str(n + 1)]
    assert 16 < n < 200 and fit["compiles"] <= 6
    # The hosts' RAM beside the peak holds the rest of the live adapters' pages.
    assert fit["max_live_adapters"] == n + host["page_capacity"] > n
    # A count over the line is refused (exit code 1) by the compiler's first program.
    over = serve_plan("v5e-4", f"serve.max_adapters={n + 1}", *SMALL, "plan.max_fit_compiles=0", code=1)
    assert not over["fits"] and "adapters_that_fit" not in over


def test_a_serve_plan_needs_a_target(capsys):
    done = podtrain("plan", "--serve")
    assert done.returncode == 2 and done.stderr.strip().endswith("--serve: expected --target (a TPU slice or GPU "
                                                                 "nodes, e.g. v5p-16 or h100x8)")
