"""`podtrain check`: a few train steps of the configured optimizer on random tokens."""


def test_check_runs_the_configured_optimizer(capsys):
    from podtrain.launch.cli import main

    tiny = ["model.num_layers=1", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=384",
            "model.head_dim=16", "train.seq_len=16", "optimizer.name=sgd"]
    assert main(["check", "-c", "llama3-tiny", *tiny, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "running 2 train steps (forward, loss, backward, sgd update) on random tokens" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "(includes compilation)" in steps[0] and "compilation" not in steps[1]
