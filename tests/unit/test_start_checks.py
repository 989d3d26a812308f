"""What a command checks before it starts (in-process parts; real processes: tests/e2e/test_first_contact.py):
the data-dir lock, a GGUF cut short, a port taken, a market that does not answer as one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.lockfile import hold, holder_pid
from swarm.model.gguf_check import check_gguf_file, expected_size
from swarm.preflight import check_listen_addrs, check_port_free, token_refusal
from tests.conftest import FIXTURES

GOLDEN = sorted((FIXTURES / "golden").glob("*.gguf"))


def test_one_holder_at_a_time_and_a_dead_holders_file_is_no_obstacle(tmp_path: Path) -> None:
    lock = tmp_path / "v" / "lock"
    with hold(lock, flag="--data-dir", shown=str(tmp_path / "v"), what="volunteer"):
        assert holder_pid(lock) == os.getpid()
        # a second holder, even in this process (flock locks belong to an open file)
        with pytest.raises(ConfigError, match=rf"^--data-dir {tmp_path / 'v'} is in use by another moe-swarm volunteer "
                                              rf"\(pid {os.getpid()}\); stop it, or give this one its own --data-dir$") as ei:
            with hold(lock, flag="--data-dir", shown=str(tmp_path / "v"), what="volunteer"):
                pass
        assert ei.value.code == "data_dir_in_use"
    with hold(lock, flag="--data-dir", shown="x", what="volunteer"):  # released at the end of the block
        pass
    # a process that took the lock and died (SIGKILL leaves no chance to clean up): its file stays, its lock not
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX);"
            "os.ftruncate(fd, 0); os.write(fd, str(os.getpid()).encode()); os.kill(os.getpid(), 9)")
    dead = subprocess.Popen([sys.executable, "-c", code, str(lock)])
    assert dead.wait(timeout=60) == -9 and holder_pid(lock) == dead.pid
    with hold(lock, flag="--data-dir", shown="x", what="volunteer"):
        assert holder_pid(lock) == os.getpid()


def test_a_data_dir_that_cannot_be_written_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"^--data-dir {tmp_path}/file/v: cannot create {tmp_path}/file/v/lock "
                                          r"\(Not a directory\); give a --data-dir this user can write$"):
        with hold(tmp_path / "file" / "v" / "lock", flag="--data-dir", shown=f"{tmp_path}/file/v", what="relay"):
            pass


@pytest.mark.parametrize("path", GOLDEN[:6], ids=lambda p: p.name)
def test_a_gguf_cut_short_anywhere_is_an_incomplete_download(path: Path, tmp_path: Path) -> None:
    data = path.read_bytes()
    assert expected_size(path) == len(data)
    check_gguf_file(path, "--model")  # whole: nothing to say
    for cut in (len(data) - 1, len(data) // 2, 4096, 100, 10, 3):
        part = tmp_path / "part.gguf"
        part.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=r"incomplete download\?$") as ei:
            check_gguf_file(part, "--model")
        assert str(ei.value).startswith(f"--model {part}: ") and ei.value.code == "truncated_gguf"
        if cut > 4096:
            assert f"({cut:,} of {len(data):,} bytes)" in str(ei.value)


def test_what_is_not_a_gguf_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_text("<html>not found</html>")
    cases = {tmp_path / "x.gguf": "not a GGUF file we can read (it starts with b'<htm', not b'GGUF')",
             tmp_path / "missing.gguf": "no such file", tmp_path: "is a directory, not a GGUF file"}
    for path, said in cases.items():
        with pytest.raises(ConfigError) as ei:
            check_gguf_file(path, "--draft-model")
        assert str(ei.value) == f"--draft-model {path}: {said}"


def test_a_port_in_use_is_named_with_its_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^--port {port}: 127.0.0.1:{port} is already in use \(another process "
                                              r"listens there\); stop it, or choose another port$"):
            check_port_free("127.0.0.1", port, "--port")
        addr = f"/ip4/127.0.0.1/tcp/{port}"
        with pytest.raises(ConfigError, match=rf"^--listen {addr}: 127.0.0.1:{port} is already in use"):
            check_listen_addrs(["/ip4/127.0.0.1/tcp/0", addr], "--listen")
    check_port_free("127.0.0.1", port, "--port")  # closed: free again
    check_port_free("127.0.0.1", 0, "--port")
    with pytest.raises(ConfigError, match=r"^--host 192.0.2.1: not an address of this machine$"):
        check_port_free("192.0.2.1", port, "--port")


def test_a_refused_token_says_what_the_market_answered() -> None:
    body = b'{"error":{"message":"operator token required (Authorization: Bearer TOKEN)","type":"invalid_request_error","code":"unauthorized","param":null}}'
    assert token_refusal(401, body, token_given=True) == "refused the operator token (HTTP 401 unauthorized)"
    assert token_refusal(401, body, token_given=False) == (
        "requires an operator token (HTTP 401 unauthorized): give --token or set MOE_SWARM_TOKEN")
    assert token_refusal(403, b"<html>proxy</html>", token_given=True) == "refused the operator token (HTTP 403 no error code)"
