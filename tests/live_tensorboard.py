"""A real `tensorboard` server on 127.0.0.1 for the tests (the `tensorboard_server` fixture
in conftest.py): started on a free port over a log folder, stopped after the test."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(port, path, params=None):
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def start_tensorboard(log_dir, servers):
    """Starts `tensorboard` on a free port of 127.0.0.1 (appended to `servers`); returns the
    port once it serves a run with the mixed_precision tags."""
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    servers.append(proc)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            tags = get_json(port, "/data/plugin/scalars/tags")
            if any("mixed_precision/loss_scale" in run_tags for run_tags in tags.values()):
                return port
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail("tensorboard did not serve the run within 90 s")


def stop(servers):
    for proc in servers:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
