"""The token-path trace (meshnet_p2p/core/trace.py): off by default, one JSON line
per event when on, one clock for every process of the machine."""

import json
import os
import subprocess
import sys

from meshnet_p2p.core import trace


def test_off_it_writes_nothing_and_on_it_writes_one_line_per_event(tmp_path):
    path = tmp_path / "t.jsonl"
    trace.start(None)
    trace.event("nothing", pos=1)
    assert not trace.enabled() and not path.exists()
    trace.start(str(path))
    try:
        trace.name("test")
        trace.event("a", pos=3)
        trace.event("b", pos=4, attached=True)
    finally:
        trace.start(None)
        trace.name("")
    a, b = [json.loads(line) for line in path.read_text().splitlines()]
    assert (a["ev"], a["pos"], a["who"], b["ev"], b["attached"]) == ("a", 3, "test", "b", True)
    assert a["t"] <= b["t"] and a["pid"] == os.getpid()
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_processes_started_with_the_variable_append_to_one_timeline(tmp_path):
    path = tmp_path / "t.jsonl"
    code = "from meshnet_p2p.core import trace; trace.event('child')"
    for _ in range(2):  # each a process of its own: lines append, timestamps on one clock
        subprocess.run([sys.executable, "-c", code], env={**os.environ, trace.ENV: str(path)}, check=True)
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["pid"] != second["pid"] and first["t"] < second["t"]


def test_a_trace_file_that_cannot_be_written_is_a_warning_not_the_end_of_the_process(tmp_path):
    """Seen failing before the fix: the import raised FileNotFoundError, so every command died."""
    code = "from meshnet_p2p.core import trace; trace.event('x'); print(trace.enabled())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, trace.ENV: str(tmp_path / "missing" / "t.jsonl")})
    assert r.returncode == 0 and r.stdout.strip() == "False"
    assert "cannot be written" in r.stderr and "Traceback" not in r.stderr
