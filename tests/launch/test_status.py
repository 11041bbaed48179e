"""`podtrain status <run dir>`: a job's attempts from its job.json, and one line for a directory without one."""

import json

from podtrain.launch import cli

JOB = {"status": "succeeded", "reason": "trained to step 30", "attempts": 2, "restarts": {"hang": 1}, "last_step": 30,
       "last_checkpoint": 30, "run_dir": "/runs/r",
       "history": [{"attempt": 1, "started_at": 0.0, "start_step": None, "first_step_at": 9.0, "last_step": 5,
                    "ended": "hang", "rank": 1, "phase": "save", "detail": "rank 1 is behind", "detected_at": 40.0,
                    "detect_s": 30.5, "restart_s": 21.25, "steps_redone": 1, "slices": 2},
                   {"attempt": 2, "started_at": 41.0, "start_step": 4, "first_step_at": 61.25, "last_step": 30,
                    "ended": "done", "rank": None, "phase": None, "detail": "", "detected_at": 90.0,
                    "detect_s": None, "restart_s": None, "steps_redone": None}]}


def test_status_prints_each_attempt_and_what_its_ending_cost(tmp_path, capsys):
    (tmp_path / "job.json").write_text(json.dumps(JOB))
    assert cli.main(["status", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "/runs/r: succeeded (trained to step 30); last step 30, last checkpoint 30, 2 attempts"
    assert lines[2].split() == ["1", "hang", "2", "1", "save", "30.5s", "21.2s", "1", "rank", "1", "is", "behind"]
    assert lines[3].split() == ["2", "done", "-", "-", "-", "-", "-", "-"]  # a record from before slices
    assert cli.main(["status", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == JOB


def test_status_of_a_directory_without_a_job_record_is_one_line(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"podtrain: error: {tmp_path / 'job.json'}: expected the job record a cluster run writes "
                   "(cluster.kind local, tpu or gpu), found none"]
