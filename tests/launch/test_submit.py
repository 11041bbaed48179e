"""`podtrain submit` against a head whose job agent is not up yet."""

import pytest

from podtrain.launch import submit
from podtrain.orchestrator.common.errors import ConfigError

NO_AGENT = RuntimeError("Request failed with status code 500: No available agent to submit job, please try again "
                        "later.")


class FakeClient:
    def __init__(self, errors):
        self.errors, self.jobs = list(errors), []

    def submit_job(self, **job):
        if self.errors:
            raise self.errors.pop(0)
        self.jobs.append(job)


def test_a_head_without_its_job_agent_yet_is_tried_again_then_named(monkeypatch, capsys):
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    client = FakeClient([NO_AGENT, NO_AGENT])
    submit.submit_when_agent_is_up(client, "http://head:8265", submission_id="run")
    assert client.jobs == [{"submission_id": "run"}]
    assert capsys.readouterr().out.count("has no job agent yet; trying again for up to 60s") == 1

    with pytest.raises(ConfigError, match=r"--address http://head:8265: Ray's head has had no job agent for 0s"):
        submit.submit_when_agent_is_up(FakeClient([NO_AGENT]), "http://head:8265", wait_s=0, submission_id="run")
    with pytest.raises(RuntimeError, match="status code 400"):  # anything else is not waited on
        submit.submit_when_agent_is_up(FakeClient([RuntimeError("status code 400")]), "http://head:8265")
