"""ServerConfig: `pagedllm serve`'s own settings, one flag each derived from the field, validated in
one place before any model load."""

import argparse
import dataclasses
from dataclasses import fields

import pytest

from pagedllm.config import EngineConfig, flag_name
from pagedllm.server.cli import serve_configs
from pagedllm.server.config import CONNECTIONS, CORS, ServerConfig, string_list


def _serve_parser() -> argparse.ArgumentParser:
    from pagedllm.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def _parse(*flags: str) -> argparse.Namespace:
    from pagedllm.cli import build_parser

    return build_parser().parse_args(["serve", *flags])


def test_every_server_field_has_exactly_one_flag_declared_by_the_field():
    parser = _serve_parser()
    actions = {}
    for action in parser._actions:
        assert action.dest not in actions, f"two flags set {action.dest}"
        actions[action.dest] = action
    for f in fields(ServerConfig):
        action = actions[f.name]
        assert action.option_strings[0] == flag_name(f) == "--" + f.name.replace("_", "-")
        assert f.metadata["help"] and action.help.startswith(f.metadata["help"].replace("%", "%%"))
        assert action.default == f.default
    assert not {f.name for f in fields(ServerConfig)} & {f.name for f in fields(EngineConfig)}
    sections = {group.title: {a.dest for a in group._group_actions} for group in parser._action_groups}
    assert {"max_connections", "allowed_hosts"} <= sections[CONNECTIONS]
    assert {"allowed_origins", "allow_credentials"} <= sections[CORS]


def test_the_defaults_are_the_configs():
    config, settings = serve_configs(_parse())
    assert settings == ServerConfig()
    assert settings.host == "127.0.0.1" and settings.api_key is None  # loopback, no key
    assert config == EngineConfig(max_num_batched_tokens=2048)


def test_the_flags_map_back_to_the_settings():
    settings = serve_configs(_parse(
        "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "m", "--max-body-bytes", "10",
        "--max-waiting-requests", "3", "--num-threads", "2", "--max-connections", "5",
        "--header-timeout-s", "1.5", "--body-timeout-s", "2", "--keep-alive-s", "3",
        "--allowed-hosts", "a.example, b.example:80", "--allowed-origins", '["https://x.example"]',
        "--allowed-methods", "GET,POST", "--allow-credentials"))[1]
    assert settings == ServerConfig(
        host="0.0.0.0", port=9000, served_model_name="m", max_body_bytes=10, max_waiting_requests=3,
        num_threads=2, max_connections=5, header_timeout_s=1.5, body_timeout_s=2.0, keep_alive_s=3.0,
        allowed_hosts=("a.example", "b.example:80"), allowed_origins=("https://x.example",),
        allowed_methods=("GET", "POST"), allow_credentials=True)


@pytest.mark.parametrize("text,expected", [
    ('["a", "b"]', ("a", "b")), ("a, b,,", ("a", "b")), ("*", ("*",)), ("[]", ()),
])
def test_string_lists_are_json_or_comma_separated(text, expected):
    assert string_list(text) == expected


@pytest.mark.parametrize("text", ['["a", 1]', "[nope", '["a"'])
def test_a_bad_list_is_refused_by_the_parser(text, capsys):
    with pytest.raises(SystemExit):
        _parse("--allowed-origins", text)
    assert "--allowed-origins" in capsys.readouterr().err


@pytest.mark.parametrize("changes,words", [
    ({"port": 70000}, "port must be a TCP port"),
    ({"max_body_bytes": 0}, "max_body_bytes must be a positive integer"),
    ({"max_waiting_requests": -1}, "max_waiting_requests must be a positive integer"),
    ({"num_threads": 0}, "num_threads must be a positive integer"),
    ({"max_connections": 0}, "max_connections must be a positive integer"),
    ({"body_timeout_s": 0}, "body_timeout_s must be a positive number of seconds"),
    ({"keep_alive_s": float("nan")}, "keep_alive_s must be a positive number of seconds"),
    ({"allowed_hosts": ["a"]}, "allowed_hosts must be"),
    ({"allow_credentials": "yes"}, "allow_credentials must be true or false"),
    ({"api_key": "k", "api_key_file": "f"}, "not both"),
])
def test_bad_settings_are_refused_in_one_place(changes, words):
    with pytest.raises(ValueError, match=words):
        ServerConfig(**changes)


def test_settings_are_not_changed_once_made():
    settings = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1


def test_the_model_comes_as_serve_model_or_model_not_two():
    assert serve_configs(_parse("m.gguf"))[0].model == "m.gguf"
    assert serve_configs(_parse("--model", "m.gguf"))[0].model == "m.gguf"
    assert serve_configs(_parse("m.gguf", "--model", "m.gguf"))[0].model == "m.gguf"
    args = _parse("a.gguf", "--model", "b.gguf")
    with pytest.raises(ValueError, match="two models given"):
        serve_configs(args)
    assert args.model == "b.gguf"  # the parsed flags are left as they were


def test_the_readme_names_every_server_flag():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    missing = [flag_name(f) for f in fields(ServerConfig) if flag_name(f) not in readme]
    assert not missing, f"README.md lacks {missing}"


def test_the_api_key_never_shows_in_the_settings_repr():
    assert "s3cret" not in repr(ServerConfig(api_key="s3cret"))
