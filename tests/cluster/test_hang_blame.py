"""Which rank a hung gang is blamed on: a stopped process, the one behind, the one whose main thread runs."""

import subprocess
import sys
import time

from podtrain.orchestrator.cluster import driver


def poll(step, state="S", pid=None):
    return {"returncode": None, "heartbeat": (step, 0.0), "state": state, "pid": pid}


def test_a_hang_is_blamed_on_the_stopped_rank_then_the_one_behind():
    """Every rank of a gang waits for the one that stopped, so their heartbeats read the same step."""
    assert driver.blame([poll(3), poll(3, "T")], ["", ""], first=0) == (
        1, "rank 1's process is stopped (state T: SIGSTOP or a debugger)")
    assert driver.blame([poll(4), poll(4), poll(3)], ["", "", ""], first=0) == (
        2, "rank 2 is behind (at step 3, others at 4)")
    assert driver.blame([poll(4), poll(4)], ["", ""], first=0) == (0, "every rank waits")


def test_a_hang_is_blamed_on_the_rank_whose_main_thread_runs_while_the_others_wait(tmp_path):
    """Real py-spy dumps of a process spinning in Python and one waiting in a system call."""
    from podtrain.orchestrator.cluster.host import HostActor

    programs = ["import time\nwhile True: time.sleep(60)", "while True: pass"]
    procs = [subprocess.Popen([sys.executable, "-c", program]) for program in programs]
    try:
        time.sleep(2.0)
        stacks = []
        for rank, proc in enumerate(procs):
            actor = HostActor(rank)
            actor.proc, actor.files = proc, {"stacks": tmp_path / f"rank{rank}.stacks"}
            stacks.append(actor.dump_stacks(str(tmp_path / f"rank{rank}.txt")))
        polls = [poll(5, "S", procs[0].pid), poll(5, "R", procs[1].pid)]
        assert driver.blame(polls, stacks, first=0) == (1, "rank 1's main thread is running while the other ranks "
                                                           "wait"), stacks
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
