"""Who may read the status endpoint: open on loopback; off loopback every request needs the bearer
token unless ``--status-open-read`` opens GET; the address printed for a wildcard bind. Fake runs,
real HTTP (bound on 127.0.0.1 or 0.0.0.0, reached through 127.0.0.1)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from fsm_agent.config import LaunchConfig
from fsm_agent.errors import ConfigError
from fsm_agent.plugins import status_http

pytestmark = pytest.mark.unit

TOKEN = "s3cret-token"
#: What /status says that a refused client must not see.
DETAILS = ('"pid"', '"entrypoint"', '"workers"', '"node"', '"membership"')


def request(url: str, method: str = "GET", token: str | None = None) -> tuple[int, dict[str, str], str]:
    """(status code, headers, body) of ``method url``, with ``Authorization: Bearer token`` when given."""
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def start(make_agent, tmp_path, **options) -> tuple[status_http.LiveStatus, str]:
    """An agent (never run) with the status endpoint on a free port; (its server, ``http://127.0.0.1:PORT``)."""
    agent = make_agent(config=LaunchConfig(plugins={"status-http": {"port": 0, **options}}))
    status = agent.plugin_manager.get_plugin("status-http-server")
    assert status is not None
    return status, f"http://127.0.0.1:{status._server.server_address[1]}"


def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_off_loopback_every_request_needs_the_token(make_agent, tmp_path):
    status, base = start(make_agent, tmp_path, host="0.0.0.0", token_file=token_file(tmp_path))
    try:
        for path in ("/status", "/status?transitions=5", "/statechart", "/healthz", "/no-such-path"):
            for token in (None, "wrong", ""):
                code, headers, body = request(base + path, token=token)
                assert code == 401, (path, token, body)
                assert headers.get("WWW-Authenticate") == "Bearer"
                assert not any(word in body for word in DETAILS), body
                assert "/status" not in body and "paths" not in body  # not even which paths exist
        code, _, body = request(base + "/status", token=TOKEN)
        assert code == 200 and json.loads(body)["state"] == "INIT"
        assert request(base + "/statechart", token=TOKEN)[0] == 200
        assert request(base + "/healthz", token=TOKEN)[:3:2] == (200, "ok\n")
        assert request(base + "/no-such-path", token=TOKEN)[0] == 404
        # POST /drain: the token from every client, a loopback one too
        for token in (None, "wrong"):
            code, _, body = request(base + "/drain", "POST", token)
            assert code == 401, body
        assert status._agent.drain_request is None
        assert request(base + "/drain?scope=node", "POST", TOKEN)[0] == 202
    finally:
        status.close()


def test_open_read_serves_get_to_anyone_but_drain_still_needs_the_token(make_agent, tmp_path):
    status, base = start(make_agent, tmp_path, host="0.0.0.0", token_file=token_file(tmp_path), open_read=True)
    try:
        code, _, body = request(base + "/status")
        assert code == 200 and json.loads(body)["state"] == "INIT"
        assert request(base + "/healthz")[0] == 200
        assert request(base + "/drain", "POST")[0] == 401
        assert request(base + "/drain", "POST", "wrong")[0] == 401
        assert status._agent.drain_request is None
        assert request(base + "/drain", "POST", TOKEN)[0] == 202
    finally:
        status.close()


def test_open_read_without_a_token_file_refuses_every_drain(make_agent, tmp_path):
    status, base = start(make_agent, tmp_path, host="0.0.0.0", open_read=True)
    try:
        assert request(base + "/status")[0] == 200
        code, _, body = request(base + "/drain", "POST", TOKEN)
        assert code == 403 and "--status-token-file" in json.loads(body)["error"]
        assert status._agent.drain_request is None
    finally:
        status.close()


def test_off_loopback_without_a_token_or_open_read_is_a_config_error(make_agent):
    config = LaunchConfig(plugins={"status-http": {"port": 0, "host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match=r"--status-host 0\.0\.0\.0: .*--status-token-file.*--status-open-read"):
        make_agent(config=config)


def test_loopback_stays_open_to_loopback_clients(make_agent, tmp_path):
    """The default bind: GET without a token (``fsm-agent status`` relies on it), and a loopback
    client may drain without it even when the agent has a token file."""
    status, base = start(make_agent, tmp_path, token_file=token_file(tmp_path))
    try:
        assert request(base + "/status")[0] == 200
        assert request(base + "/statechart")[0] == 200
        assert request(base + "/drain", "POST")[0] == 202
    finally:
        status.close()


def test_a_wildcard_bind_prints_an_address_a_client_can_use(make_agent, tmp_path, capsys):
    path = token_file(tmp_path)
    status, base = start(make_agent, tmp_path, host="0.0.0.0", token_file=path)
    try:
        port = status._server.server_address[1]
        assert status._server.server_address[0] == "0.0.0.0"
        lines = capsys.readouterr().err.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.startswith("fsm-agent: status at ")]
        url = lines[at].split()[-1]
        assert url == f"{status.url}/status"
        host = url.removeprefix("http://").rpartition(":")[0]
        assert host and host not in ("0.0.0.0", "[::]"), lines
        assert url.endswith(f":{port}/status")
        note = lines[at + 1]
        assert "0.0.0.0" in note and "Authorization: Bearer" in note and path in note, note
    finally:
        status.close()


def test_the_wildcard_address_falls_back_to_a_non_loopback_address(monkeypatch):
    """No usable name (both say localhost): this host's first non-loopback address."""
    monkeypatch.setattr(status_http.socket, "gethostname", lambda: "localhost")
    monkeypatch.setattr(
        status_http.socket,
        "getaddrinfo",
        lambda *a, **k: [(2, 1, 6, "", ("127.0.0.1", 0)), (2, 1, 6, "", ("10.9.8.7", 0))],
    )
    assert status_http.reachable_host("0.0.0.0", "localhost") == "10.9.8.7"
    assert status_http.reachable_host("0.0.0.0", "node7.cluster") == "node7.cluster"
    assert status_http.reachable_host("10.1.2.3", "node7.cluster") == "10.1.2.3"
    assert status_http.reachable_host("127.0.0.1", "node7.cluster") == "127.0.0.1"


def test_the_status_command_sends_the_token_it_is_given(make_agent, tmp_path, capsys):
    from fsm_agent.status_cli import StatusUnavailable, cli_main

    status, base = start(make_agent, tmp_path, host="0.0.0.0", token_file=token_file(tmp_path))
    try:
        with pytest.raises(StatusUnavailable, match=r"HTTP 401 .*give --status-token-file FILE"):
            cli_main([base, "--json"])
        assert cli_main([base, "--json", "--status-token-file", token_file(tmp_path)]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "INIT"
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-token")
        with pytest.raises(StatusUnavailable, match="HTTP 401 .*check the token file"):
            cli_main([base, "--status-token-file", str(wrong)])
        with pytest.raises(ConfigError, match="--status-token-file .*cannot read it"):
            cli_main([base, "--status-token-file", str(tmp_path / "missing")])
    finally:
        status.close()
