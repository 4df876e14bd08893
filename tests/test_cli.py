import subprocess
import sys

from zero_strategy.cli import main


def test_env_reports_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "gloo" in out


def test_unknown_command_exits_with_usage():
    proc = subprocess.run(
        [sys.executable, "-m", "zero_strategy.cli", "bogus"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
