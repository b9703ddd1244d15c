"""Check before the slow work: flags, files (existence, magic, header) and the port are checked
before the model loads, so a request that cannot succeed fails in a second, never after minutes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.tiny_models import CORPUS

runner = CliRunner()


@pytest.fixture()
def no_model(monkeypatch):
    """Any model load fails the test (the command must have failed before it)."""
    import kite.model
    import kite.model.loader

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    for module in (kite.model, kite.model.loader):
        monkeypatch.setattr(module, "load_model", loaded)
        monkeypatch.setattr(module, "load_config_only", loaded)


def refused(args: list[str], fragment: str, code: int = 2, report: bool = False) -> str:
    """The command's error line (a rule set's full report may come before it with `report`)."""
    result = runner.invoke(app, args)
    assert "the model was loaded" not in result.output, result.output
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (report or len(lines) == 1) and fragment in lines[-1], result.output
    return lines[-1]


def test_eval_unknown_probe(no_model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    refused(["upcycle", "eval", "--input", str(doc), "--probe", "nosuch"], "--probe nosuch: expected one of passkey, keys, qa")


def test_eval_unknown_dtype(no_model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    refused(["upcycle", "eval", "--input", str(doc), "--dtype", "fp8"], "--dtype fp8: expected one of fp32, fp16, bf16")


def test_generate_missing_or_corrupt_state(no_model, tmp_path):
    refused(["generate", "--upc", str(tmp_path / "nosuch.upc"), "--prompt", "hi"], "no such state file")
    bad = tmp_path / "bad.upc"
    bad.write_bytes(b"not a state at all, just some bytes" * 10)
    refused(["generate", "--upc", str(bad), "--prompt", "hi"], "not a .upc state")


def test_generate_checks_clusters_layers_and_precision_against_the_header(no_model, tiny_contract_state):
    state = str(tiny_contract_state[2])
    refused(["generate", "--upc", state, "--prompt", "hi", "--clusters", "nosuch"], "--clusters nosuch: not in this state")
    refused(["generate", "--upc", state, "--prompt", "hi", "--layers", "0-7"], "out of range 0-2")
    refused(["generate", "--upc", state, "--prompt", "hi", "--precision", "int5"], "--precision int5: expected one of")


def test_yoco_decide_corrupt_state(no_model, tmp_path):
    bad = tmp_path / "bad.upc"
    bad.write_bytes(b"KITEUPC\x00" + b"\x01" * 7)  # the magic, then a header cut off
    refused(["yoco", "decide", "--state", str(bad), "--query", "q"], "truncated")
    refused(["yoco", "decide", "--state", str(tmp_path / "none.upc"), "--query", "q"], "no such state file")


def test_yoco_decide_checks_the_rules_against_the_state_first(no_model, tiny_contract_state):
    # the shipped rules name layers 12-18; the tiny state's model has 3
    refused(["yoco", "decide", "--state", str(tiny_contract_state[2]), "--query", "q"], "error in the rule set",
            report=True)


@pytest.mark.parametrize("command", ["compress", "eval"])
@pytest.mark.parametrize("case", ["missing", "empty"])
def test_a_bad_input_fails_before_torch_is_even_imported(command, case, tmp_path):
    doc = tmp_path / "doc.txt"
    if case == "empty":
        doc.write_text("  \n")
    args = ["upcycle", command, "--input", str(doc)] + (["--output", str(tmp_path / "d.upc")]
                                                         if command == "compress" else [])
    code = (f"import sys; sys.argv = ['kite', *{args!r}]\n"
            "from kite.cli.main import main\n"
            "try:\n main()\nexcept SystemExit as e: code = e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert ("no such file" if case == "missing" else "the document is empty") in proc.stderr


def test_serve_on_a_busy_port_fails_before_the_model_loads(no_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = refused(["serve", "--port", str(port)], "the port is in use", code=1)
    assert f"127.0.0.1:{port}" in line


def test_serve_replicas_on_a_busy_port_fails_before_ray_starts(no_model, monkeypatch):
    pytest.importorskip("ray.serve")
    import kite.ray_session

    def connect(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(kite.ray_session, "connect", connect)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = refused(["serve", "--replicas", "2", "--port", str(port)], "the port is in use", code=1)
    assert "Ray was started" not in line and f"127.0.0.1:{port}" in line


def test_a_quiet_port_is_free_and_outside_the_ranges_the_kernel_and_ray_hand_out():
    from kite.ports import quiet_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(5):
        port = quiet_port()
        assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_serve_on_an_address_this_machine_lacks(no_model):
    refused(["serve", "--host", "192.0.2.1", "--port", "8088"], "not an address of this machine")
