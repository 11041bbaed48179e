"""W&B (offline) and MLflow (a local file store) as trackers of a real `podtrain train`, across a
kill -9 and resume; a tracker whose server cannot be reached warns once and the run goes on."""

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from train_fixtures import ROOT, command, env, losses

from podtrain.orchestrator.config.schema import MetricsConfig, MlflowConfig, WandbConfig
from podtrain.orchestrator.train.metrics import MetricsWriter


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B `.wandb` file: a 7-byte header, then LevelDB-style log records
    (checksum, length, type) in 32 KiB blocks; a record cut off by a kill ends the list."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, parts = path.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B"
    position = 7
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        if kind == 0 or position + 7 + length > len(data):
            break
        parts += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_run(run_dir: Path) -> tuple[set[str], dict[int, float], dict]:
    """(run ids, step -> last loss logged, config keys) over every attempt's offline W&B file."""
    ids, loss, config = set(), {}, {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                if "step" in items and "loss" in items:
                    loss[items["step"]] = items["loss"]
            elif kind == "config":
                config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    return ids, loss, config


@pytest.mark.slow
def test_wandb_and_mlflow_log_one_run_across_a_kill_and_resume(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's local file store, for its reader here too
    store = f"file://{tmp_path / 'mlruns'}"
    trackers = ["metrics.trackers=[jsonl,wandb,mlflow]", "metrics.wandb.mode=offline", "metrics.wandb.tags=[sft,a]",
                f"metrics.mlflow.tracking_uri={store}", "metrics.mlflow.experiment=chat"]
    run_dir = tmp_path / "tracked"
    tracker_env = dict(env(), MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true")
    proc = subprocess.Popen(command(run_dir, 1000, *trackers), cwd=ROOT, env=tracker_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    # Until W&B has written some steps of the first attempt and MLflow holds its config (the params a
    # run keeps: MLflow does not let a later attempt change them).
    while len(wandb_run(run_dir)[1]) < 3 or not any((tmp_path / "mlruns").glob("*/*/params/train.steps")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = wandb_run(run_dir)[1]
    committed = max(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())
    done = subprocess.run(command(run_dir, committed + 3, *trackers), cwd=ROOT, env=tracker_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"steps {committed} -> {committed + 3}" in done.stdout
    assert not (run_dir / "tensorboard").exists()  # not among the trackers
    final = losses(run_dir)
    assert sorted(final) == list(range(1, committed + 4))

    ids, logged, config = wandb_run(run_dir)
    attempts = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(attempts) == 2 and {p.name.rsplit("-", 1)[1] for p in attempts} == ids  # two attempts, one run
    assert set(first) | set(range(committed + 1, committed + 4)) <= set(logged)
    # the redone steps repeat the killed attempt's values (a resume is bit-exact)
    assert {s: v for s, v in logged.items() if s in final} == pytest.approx({s: final[s] for s in logged if s in final})
    assert config["train"]["steps"] == committed + 3 and config["metrics"]["wandb"]["tags"] == ["sft", "a"]

    client = MlflowClient(tracking_uri=store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "chat"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "1000" and run.data.params["model.hidden_size"] == "64"
    last = {}
    for metric in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.timestamp):
        last[metric.step] = metric.value
    assert set(final) <= set(last) and {s: last[s] for s in final} == pytest.approx(final)
    assert set(final) <= set(logged)  # what the killed attempt had not sent came with the resume
    assert json.loads((run_dir / "trackers.json").read_text()) == {
        "wandb": ids.pop(), "mlflow": run.info.run_id, "sent": {"wandb": committed + 3, "mlflow": committed + 3}}


def test_a_resume_sends_the_trackers_the_steps_a_killed_attempt_had_not_sent(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = f"file://{tmp_path / 'mlruns'}"
    metrics = MetricsConfig(trackers=["jsonl", "wandb", "mlflow"], wandb=WandbConfig(mode="offline"),
                            mlflow=MlflowConfig(tracking_uri=store))
    writer = MetricsWriter(tmp_path, enabled=True, total_steps=7, metrics=metrics, run_config={})
    for step in (1, 2):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a") as jsonl:  # steps the killed attempt wrote but had not sent
        jsonl.writelines(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in (3, 4, 5, 6))
    writer = MetricsWriter(tmp_path, enabled=True, total_steps=7, start_step=5, metrics=metrics, run_config={})
    for step in (6, 7):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()

    expected = {step: 1.0 / step for step in range(1, 8)}
    client = MlflowClient(tracking_uri=store)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert {m.step: m.value for m in client.get_metric_history(run_id, "loss")} == pytest.approx(expected)
    assert wandb_run(tmp_path)[1] == pytest.approx(expected)
    assert json.loads((tmp_path / "trackers.json").read_text())["sent"] == {"wandb": 7, "mlflow": 7}


def test_a_tracker_that_cannot_reach_its_server_warns_once_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    metrics = MetricsConfig(trackers=["jsonl", "mlflow"], mlflow=MlflowConfig(tracking_uri="http://127.0.0.1:9"))
    with caplog.at_level(logging.WARNING, logger="podtrain.orchestrator.train.trackers"):
        writer = MetricsWriter(tmp_path, enabled=True, total_steps=3, metrics=metrics, run_config={"a": 1})
        for step in (1, 2, 3):
            writer.write({"step": step, "loss": 1.0 / step})
        writer.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("metrics.trackers: mlflow could not start")


@pytest.mark.parametrize("trackers, needle", [
    (["jsonl", "neptune"], "metrics.trackers: expected some of"),
    (["jsonl", "jsonl"], "metrics.trackers: each tracker once"),
])
def test_tracker_keys_are_validated(trackers, needle):
    with pytest.raises(ValueError, match=needle):
        MetricsConfig(trackers=trackers).validate()
    with pytest.raises(ValueError, match="metrics.wandb.mode: expected one of"):
        MetricsConfig(wandb=WandbConfig(mode="cloud")).validate()


def test_wandb_offline_records_are_read_back(tmp_path):
    metrics = MetricsConfig(trackers=["wandb"], wandb=WandbConfig(mode="offline", tags=["x"]))
    os.environ.setdefault("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, enabled=True, total_steps=2, metrics=metrics, run_config={"train": {"steps": 2}})
    writer.write({"step": 1, "loss": 2.0, "expert_load": [[1, 2]], "sample": "text"})
    writer.write({"step": 2, "loss": 1.5})
    writer.close()
    ids, logged, config = wandb_run(tmp_path)
    assert len(ids) == 1 and logged == {1: 2.0, 2: 1.5} and config["train"] == {"steps": 2}
