"""`cli.serve`: what `replay-server` decides before and around a server, in this process with
stand-ins for the server and its readers (no server starts).

`tests/system/cli/` runs `replay-server` as a process: serving, signals, status, bad flags.
`replay_service.cli.demo` has no unit test: it defines absl flags of the same names as this
module's (`--checkpoint_dir`), so the two cannot be imported into one process, and its
behaviour, a whole collect-checkpoint-restore run and its argument errors, is what
`tests/system/cli/test_installed_commands.py` and `test_cli_output.py` run as a process.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from absl import flags
from absl.testing import flagsaver

from replay_service.cli import serve
from replay_service.errors import ConfigError, ServerUnavailableError
from replay_service.monitoring import report, stats
from replay_service.monitoring.report import TableReport


@pytest.fixture()
def parsed(monkeypatch, tmp_path):
    """absl's flags parsed with their defaults, each test's values restored afterwards; run in
    a directory of its own, where the default checkpoint_dir would be made."""
    monkeypatch.chdir(tmp_path)
    was_parsed = flags.FLAGS.is_parsed()
    if not was_parsed:
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver():
        yield
    if not was_parsed:
        flags.FLAGS.unparse_flags()


def exit_line(capsys, call) -> str:
    with pytest.raises(SystemExit) as raised:
        call()
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


def test_an_unknown_command_is_one_line(parsed, capsys):
    line = exit_line(capsys, lambda: serve.main(["replay-server", "frobnicate", "now"]))
    assert line == (
        "replay-server: error: unknown command 'frobnicate now'; use no command or 'status'"
    )


def test_status_needs_an_address(parsed, capsys):
    line = exit_line(capsys, lambda: serve.main(["replay-server", "status"]))
    assert line == "replay-server: error: status needs --address=host:port"


def test_status_prints_the_report_and_names_a_server_that_is_down(parsed, capsys, monkeypatch):
    tables = [TableReport("t", 1, 4, 2, 3, "uniform", "fifo", "nested")]
    asked = []

    def status(address, timeout):
        asked.append((address, timeout))
        return tables

    monkeypatch.setattr(report, "server_status", status)
    flags.FLAGS.address = "host:1"
    flags.FLAGS.timeout = 2.5
    assert serve.main(["replay-server", "status"]) == 0
    assert asked == [("host:1", 2.5)]
    assert capsys.readouterr().out == report.format_status("host:1", tables, None) + "\n"

    def down(address, timeout):
        raise ServerUnavailableError(f"no Reverb server answered at {address!r}")

    monkeypatch.setattr(report, "server_status", down)
    line = exit_line(capsys, lambda: serve.main(["replay-server", "status"]))
    assert line == "replay-server: error: no Reverb server answered at 'host:1'"


def test_status_json_prints_the_stats_sorted(parsed, capsys, monkeypatch):
    class Stats:
        def to_json(self):
            return {"b": 1, "a": {"d": 2, "c": 3}}

    seen = {}

    def server_stats(address, timeout, span_s, checkpoint):
        seen.update(address=address, span_s=span_s, checkpoint=checkpoint)
        return Stats()

    monkeypatch.setattr(stats, "server_stats", server_stats)
    flags.FLAGS.address = "host:2"
    flags.FLAGS.json = True
    flags.FLAGS.rate_span_s = 0.25
    assert serve.main(["replay-server", "status"]) == 0
    out = capsys.readouterr().out
    assert out == json.dumps({"a": {"c": 3, "d": 2}, "b": 1}, indent=2, sort_keys=True) + "\n"
    assert seen == {"address": "host:2", "span_s": 0.25, "checkpoint": None}


def test_a_bad_exporter_flag_fails_before_the_checkpoint_directory_is_touched(
    parsed, capsys, tmp_path
):
    out = tmp_path / "ckpt"
    flags.FLAGS.checkpoint_dir = str(out)
    flags.FLAGS.summary_interval_s = 0.0
    line = exit_line(capsys, lambda: serve.main(["replay-server"]))
    assert line == "replay-server: error: --summary_interval_s must be a finite number > 0, got 0.0"
    assert not out.exists()


def test_a_bad_config_value_is_named_before_anything_starts(parsed, capsys, tmp_path):
    flags.FLAGS.checkpoint_dir = str(tmp_path / "ckpt")
    flags.FLAGS.keep_checkpoints = 0
    line = exit_line(capsys, lambda: serve.main(["replay-server"]))
    assert line == (
        "replay-server: error: defaults: server.keep_checkpoints must be an integer >= 1, got 0"
    )
    assert not (tmp_path / "ckpt").exists()


def test_the_tensorboard_dir_is_checked_with_the_other_exporter_flags(parsed, tmp_path):
    (tmp_path / "file").write_text("")
    flags.FLAGS.tensorboard_dir = str(tmp_path / "file" / "tb")
    with pytest.raises(ConfigError, match="--tensorboard_dir"):
        serve._check_exporter_flags()
    flags.FLAGS.tensorboard_dir = str(tmp_path / "tb")
    serve._check_exporter_flags()


def test_a_second_stop_signal_is_counted_and_announced(capfd):
    stop = serve._StopFlag()
    stop(signal.SIGTERM, None)
    assert stop.signals == 1 and capfd.readouterr().err == ""
    stop(signal.SIGINT, None)
    assert stop.signals == 2
    assert capfd.readouterr().err == (
        "replay-server: already stopping (final checkpoint in progress)\n"
    )


def test_late_stats_report_the_server_down_until_it_is_up():
    late = serve._LateStats()
    with pytest.raises(ServerUnavailableError, match="still starting"):
        late()
    late.read = lambda: "stats"
    assert late() == "stats"


def test_stop_signals_are_ignored_for_the_rest_of_the_process():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve._ignore_stop_signals()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_exporters_that_fail_to_start_stop_the_metrics_and_the_server(parsed, monkeypatch):
    closed: list[str] = []

    class Server:
        client = object()

        def stop(self) -> None:
            closed.append("server")

    class Metrics:
        def close(self) -> None:
            closed.append("metrics")

    class Tracker:
        def __init__(self, client: Any, timeout: float) -> None:
            raise ServerUnavailableError("no answer")

    monkeypatch.setattr(stats, "StatsTracker", Tracker)
    with pytest.raises(ServerUnavailableError, match="no answer"):
        serve._start_exporters(Server(), serve._LateStats(), Metrics())
    assert closed == ["metrics", "server"]


def test_started_exporters_point_the_metrics_at_the_servers_stats(parsed, monkeypatch):
    reads = []

    class Tracker:
        def __init__(self, client: Any, timeout: float) -> None:
            self.client = client

        def read(self, checkpoint: Any = None, wait_for_rates: bool = True) -> Any:
            reads.append((checkpoint, wait_for_rates))
            return "stats"

    class Server:
        client = object()
        last_checkpoint = None
        last_checkpoint_duration_s = None

    monkeypatch.setattr(stats, "StatsTracker", Tracker)
    late = serve._LateStats()
    assert serve._start_exporters(Server(), late, None) == []
    assert reads == [(None, False)]  # the start of the first rate window
    assert late() == "stats"
    assert serve._start_metrics(late) is None  # no --metrics_port
