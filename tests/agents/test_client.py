"""The control-plane client: the node token on disk, error classes, backoff with jitter."""

import os
import stat

import pytest

from agents.client import (
    Backoff,
    ControlPlaneClient,
    ControlPlaneUnavailable,
    Rejected,
    Unauthorized,
)


def registration(name="node-c"):
    return {"name": name, "cpus": 4, "memory_mib": 1024, "labels": {}, "gpus": []}


def test_the_node_token_is_kept_readable_by_the_agent_only_and_reused(control_plane, state_dir):
    client = ControlPlaneClient(
        control_plane.url, state_dir=state_dir, join_token=control_plane.JOIN_TOKEN
    )
    assert client.node_token is None
    answer = client.register(registration())
    token_file = state_dir / "node-token"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert token_file.read_text().strip() == answer["node_token"] == client.node_token

    later = ControlPlaneClient(control_plane.url, state_dir=state_dir)
    assert later.node_token == answer["node_token"]
    later.heartbeat({"seq": 1, "sent_at": 0.0, "gpus": [], "attempts": []})
    assert control_plane.heartbeat_tokens == [answer["node_token"]]


def test_a_token_file_left_readable_by_others_is_tightened(state_dir):
    token_file = state_dir / "node-token"
    token_file.write_text("gcpn_abc\n")
    os.chmod(token_file, 0o644)
    client = ControlPlaneClient("http://127.0.0.1:1", state_dir=state_dir)
    assert client.node_token == "gcpn_abc"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600


def test_a_refused_join_token_is_unauthorized_and_leaves_no_token(control_plane, state_dir):
    client = ControlPlaneClient(control_plane.url, state_dir=state_dir, join_token="gcpj_wrong")
    with pytest.raises(Unauthorized):
        client.register(registration())
    assert not (state_dir / "node-token").exists()


def test_an_unknown_node_token_is_unauthorized(control_plane, state_dir):
    (state_dir / "node-token").write_text("gcpn_stolen\n")
    client = ControlPlaneClient(control_plane.url, state_dir=state_dir)
    with pytest.raises(Unauthorized):
        client.heartbeat({"seq": 1, "sent_at": 0.0, "gpus": [], "attempts": []})


def test_an_unreachable_control_plane_is_unavailable_not_a_crash(control_plane, state_dir):
    (state_dir / "node-token").write_text("gcpn_x\n")
    client = ControlPlaneClient(control_plane.url, state_dir=state_dir, timeout_s=2)
    control_plane.stop()
    with pytest.raises(ControlPlaneUnavailable):
        client.heartbeat({"seq": 1, "sent_at": 0.0, "gpus": [], "attempts": []})
    with pytest.raises(ControlPlaneUnavailable):
        client.watch(0.1)


def test_after_a_server_error_the_next_call_goes_out_on_a_new_connection(control_plane, state_dir):
    """Kept alive, every call would reach the same server process, even one that cannot answer
    (a web worker started during a database outage): a new connection may reach another."""
    client = ControlPlaneClient(
        control_plane.url, state_dir=state_dir, join_token=control_plane.JOIN_TOKEN
    )
    client.register(registration())
    client.send_logs(1, 0, "a")
    kept = control_plane.connections_opened
    client.send_logs(1, 1, "b")
    assert control_plane.connections_opened == kept  # kept alive while all is well

    control_plane.fail_next_log_posts = 1
    with pytest.raises(ControlPlaneUnavailable):
        client.send_logs(1, 2, "c")
    client.send_logs(1, 2, "c")

    assert control_plane.connections_opened == kept + 1


def test_server_errors_are_retryable_and_client_errors_are_not(control_plane, state_dir):
    client = ControlPlaneClient(
        control_plane.url, state_dir=state_dir, join_token=control_plane.JOIN_TOKEN
    )
    client.register(registration())
    control_plane.fail_next_log_posts = 1
    with pytest.raises(ControlPlaneUnavailable) as unavailable:
        client.send_logs(1, 0, "x")
    assert unavailable.value.status == 503
    client.base_url += "/nowhere"
    with pytest.raises(Rejected) as rejected:
        client.heartbeat({})
    assert rejected.value.status == 404


def test_backoff_doubles_up_to_its_ceiling_with_jitter_and_resets():
    draws = iter([0.0, 1.0] * 10)
    backoff = Backoff(base_s=1.0, max_s=8.0, rng=lambda: next(draws))
    delays = [backoff.next_delay_s() for _ in range(6)]
    # Drawn from [d/2, d]: the lowest and highest draw alternate here.
    assert delays == [0.5, 2.0, 2.0, 8.0, 4.0, 8.0]
    backoff.reset()
    assert backoff.next_delay_s() == 0.5


def test_backoff_delays_of_many_agents_spread_out():
    delays = {round(Backoff(base_s=4.0, max_s=4.0).next_delay_s(), 3) for _ in range(50)}
    assert len(delays) > 10
    assert all(2.0 <= d <= 4.0 for d in delays)


@pytest.fixture
def recording_proxy():
    """A real HTTP listener standing in for a forward proxy: it notes each request line it is
    sent and answers 502, as a proxy whose upstream failed does."""
    import http.server
    import threading

    seen: list[str] = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            seen.append(self.path)
            self.send_response(502)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


@pytest.mark.parametrize("bypassed", [False, True])
def test_the_proxy_settings_of_the_environment_are_honoured(
    control_plane, state_dir, recording_proxy, monkeypatch, bypassed
):
    proxy_url, seen = recording_proxy
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, proxy_url)
    for name in ("NO_PROXY", "no_proxy"):
        if bypassed:
            monkeypatch.setenv(name, "127.0.0.1")
        else:
            monkeypatch.delenv(name, raising=False)
    (state_dir / "node-token").write_text("gcpn_x\n")
    client = ControlPlaneClient(control_plane.url, state_dir=state_dir, timeout_s=5)
    body = {"seq": 1, "sent_at": 0.0, "gpus": [], "attempts": []}
    if bypassed:
        with pytest.raises(Unauthorized):  # the control plane itself refused the token
            client.heartbeat(body)
        assert seen == []
    else:
        with pytest.raises(ControlPlaneUnavailable):
            client.heartbeat(body)
        assert len(seen) == 1 and seen[0].startswith(control_plane.url)
