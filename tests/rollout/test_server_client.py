"""The trainer's side of the rollout server when the server is missing or dies: one line naming it; its serve
section's checks (secrets, TLS files).

No engine here: a port nobody listens on, and a real socket peer that hangs
up on every request (a server killed mid-answer).
"""

import json
import socket
import ssl
import threading

import pytest

from tests.helpers import free_port
from torchtitan_rl.config import JobConfig, load_toml, to_toml
from torchtitan_rl.config.validation import check_serve, redacted_dict
from torchtitan_rl.rollout.server_http import ServerClient, ServerGone


def test_a_trainer_waiting_for_its_server_says_so_every_few_seconds_then_names_it(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerGone) as e:
        ServerClient(url).wait_ready(6)
    assert url in str(e.value) and "\n" not in str(e.value)
    waiting = [line for line in capsys.readouterr().out.splitlines() if "waiting for the rollout server" in line]
    assert len(waiting) >= 2 and all(url in line for line in waiting), waiting  # at 0 s and after 5 s


def test_a_server_that_hangs_up_mid_request_is_named_in_one_line():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def hang_up():  # reads the request, then dies without an answer
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    with pytest.raises(ServerGone) as e:
        ServerClient(f"http://127.0.0.1:{port}").request("POST", "/v1/completions", {"prompt": [1]})
    listener.close()
    assert f"rollout server http://127.0.0.1:{port}: no answer to POST /v1/completions" in str(e.value)
    assert "\n" not in str(e.value)


def test_secrets_come_from_the_environment_and_config_toml_redacts_them(tmp_path, monkeypatch):
    cfg = JobConfig()
    cfg.serve.token, cfg.serve.api_key = "s3cret-token", "s3cret-key"
    text = to_toml(cfg)
    assert "s3cret" not in text and text.count("<redacted>") == 2
    assert "s3cret" not in json.dumps(redacted_dict(cfg))  # the config W&B uploads with a run
    (tmp_path / "config.toml").write_text(text)
    back = load_toml(tmp_path / "config.toml")
    with pytest.raises(ValueError, match="serve.token: the config file shows it redacted"):
        check_serve(back)
    monkeypatch.setenv("TORCHTITAN_RL_SERVE_TOKEN", "from-env")
    monkeypatch.setenv("TORCHTITAN_RL_API_KEY", "key-from-env")
    check_serve(back)
    assert (back.serve.token, back.serve.api_key) == ("from-env", "key-from-env")


def test_binding_beyond_loopback_requires_an_api_key():
    cfg = JobConfig()
    cfg.serve.token, cfg.serve.host = "t", "0.0.0.0"
    with pytest.raises(ValueError, match="serve.api_key: required when serve.host"):
        check_serve(cfg)
    cfg.serve.api_key = "k"
    check_serve(cfg)
    cfg.serve.host, cfg.serve.api_key = "127.0.0.1", ""
    check_serve(cfg)


def test_tls_files_that_are_missing_or_do_not_load_are_one_line_naming_the_field(tmp_path):
    from torchtitan_rl.serving.protocol import check_server_tls, client_tls

    cfg = JobConfig()
    cfg.serve.token, cfg.serve.ssl_keyfile = "t", str(tmp_path / "server.key")
    with pytest.raises(ValueError, match="serve.ssl_certfile: set it too"):
        check_serve(cfg)
    cfg.serve.ssl_certfile = str(tmp_path / "server.crt")
    with pytest.raises(ValueError, match=f"serve.ssl_certfile: no such file: {tmp_path / 'server.crt'}"):
        check_server_tls(cfg.serve)
    (tmp_path / "server.crt").write_text("not a certificate\n")
    (tmp_path / "server.key").write_text("not a key\n")
    with pytest.raises(ValueError, match=r"serve.ssl_certfile: cannot load .*server.crt with serve.ssl_keyfile"):
        check_server_tls(cfg.serve)
    cfg.serve.ssl_cafile = str(tmp_path / "ca.pem")
    with pytest.raises(ValueError, match="serve.ssl_cafile: cannot load"):
        client_tls(cfg.serve)


def test_the_trainer_uses_https_when_the_serve_section_has_a_certificate_or_a_ca():
    from torchtitan_rl.serving.protocol import base_url, client_tls

    cfg = JobConfig()
    cfg.serve.host, cfg.serve.port = "0.0.0.0", 8443
    assert (base_url(cfg.serve), client_tls(cfg.serve)) == ("http://127.0.0.1:8443", None)
    assert cfg.serve.in_clear_beyond_loopback()
    cfg.serve.ssl_certfile = "server.crt"  # the same section the server reads: it speaks TLS
    assert base_url(cfg.serve) == "https://127.0.0.1:8443" and not cfg.serve.in_clear_beyond_loopback()
    assert client_tls(cfg.serve).verify_mode == ssl.CERT_REQUIRED and client_tls(cfg.serve).check_hostname
