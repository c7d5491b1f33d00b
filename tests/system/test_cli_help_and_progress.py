"""Small things a user meets: the help of --redis names HARVEST_REDIS_URL (and never prints the URL
it holds, which may carry a password); --dtype, --no-progress, --max-len and --overlong say what
they do; progress is a bar redrawn in place on a terminal, and plain lines in a log."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from tests.support.cli import REPO, harvest_cli


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_help_names_the_environment_and_every_shared_option_says_what_it_does():
    secret = "redis://:hunter2@redis.internal:6379/0"
    r = harvest_cli("status", "--help", env={"HARVEST_REDIS_URL": secret})
    assert r.returncode == 0 and "hunter2" not in r.stdout
    assert (
        "--redis TEXT Redis URL (password and user go in the URL). [env var: HARVEST_REDIS_URL; default: "
        "redis://127.0.0.1:6379/0]"
    ) in _flat(r.stdout)
    r = harvest_cli("run", "--help")
    help_ = _flat(r.stdout)
    assert (
        "--dtype [bf16|fp16|fp32|fp8_e4m3] How the hidden states are stored (a new run's setting): fp8_e4m3 keeps "
        "a float32 scale per token and capture point; export converts on request. [default: bf16]"
    ) in help_
    assert "--no-progress Show no progress (else a bar on a terminal, a line every 30s in a log)." in help_
    assert (
        "--max-len INTEGER RANGE Longest sample in tokens (default and upper bound: the model's context, "
        "max_position_embeddings in its config.json)."
    ) in help_
    assert (
        "--overlong [skip|truncate|fail] A sample over its limit (--max-len or the model's context): skip it "
        "(reported with its file and line), truncate it to the limit, or fail (stop, exit 2). [default: skip]"
    ) in help_


def test_the_env_var_is_read_when_the_command_runs(tmp_path):
    """HARVEST_REDIS_URL reaches the command (a stopped Redis there is named), the flag beats it."""
    r = harvest_cli("status", "--run", "x", env={"HARVEST_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert r.returncode == 2 and "cannot reach Redis at redis://127.0.0.1:1/0" in r.stderr
    r = harvest_cli(
        "status", "--run", "x", "--redis", "redis://127.0.0.1:2/0", env={"HARVEST_REDIS_URL": "redis://127.0.0.1:1/0"}
    )
    assert r.returncode == 2 and "cannot reach Redis at redis://127.0.0.1:2/0" in r.stderr


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(tiny_model, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"text": "the model reads"}\n' for _ in range(600)))
    args = [
        sys.executable,
        "-m",
        "harvest.cli",
        "produce",
        str(data),
        "--run",
        "x",
        "--model",
        tiny_model,
        "--dry-run",
        "--progress",
    ]
    # a terminal: stderr is a pseudo-terminal, as in a person's shell
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    p = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=sub, start_new_session=True)
    os.close(sub)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out, _ = p.communicate(timeout=300)
    os.close(main)
    assert p.returncode == 0 and out.decode().startswith("rows 600: 600 samples")
    assert b"\r" in seen and b"produce: " in seen and b"600 rows" in seen and b"bad=0, samples=600]" in seen
    # a log: stderr is a file; no \r frames, whole lines, the last one with the final counts
    r = harvest_cli(*args[3:])
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and "\r" not in r.stderr
    assert lines[-1].startswith("produce: 600 rows, ") and lines[-1].endswith(", bad=0, samples=600"), lines
