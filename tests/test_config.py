"""Loading the agent's configuration: layers, typing, checks, messages, and the docs."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvwatch.collect.bpf.loader import SEND_MODES
from kvwatch.collect.table import BACKENDS
from kvwatch.config import (
    RENAMED_KEYS,
    AgentConfig,
    CollectorConfig,
    PolicyConfig,
    config_keys,
    config_to_dict,
    env_name,
    load_config,
)
from kvwatch.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    return str(path)


def error_of(
    path: str | None = None,
    env: dict[str, str] | None = None,
    flags: dict[str, object] | None = None,
) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, env or {}, flags or {})
    return str(raised.value)


def test_nothing_given_means_the_defaults() -> None:
    config = load_config(None, {}, {})
    assert config == AgentConfig()
    assert config.policy.mode == "observe"
    assert config.policy.actions == ("cancel",)
    assert (config.policy.stall_seconds, config.policy.grace_seconds) == (3.0, 2.0)
    assert config.policy.max_cancels_per_minute == 10
    assert config.hook.socket == "/run/kvwatch/engine.sock"
    assert config.hook.allowed_uids == (0,)
    assert (config.http.host, config.http.port) == ("127.0.0.1", 9431)
    assert config.audit.path == "/var/log/kvwatch/audit.jsonl"
    assert (config.path.procfs, config.path.sysfs) == ("/proc", "/sys")
    assert config.collector == CollectorConfig(max_sockets=16384)


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[policy]\nmode = "enforce"\nstall_seconds = 5\nmin_kv_bytes = 1048576\n'
        "[collector]\nports = [8000, 8001]\n",
    )
    env = {"KVWATCH_POLICY_STALL_SECONDS": "4.5", "KVWATCH_POLICY_MIN_KV_BYTES": "2048"}
    config = load_config(path, env, {"policy.min_kv_bytes": 0, "policy.grace_seconds": None})
    assert config.policy.mode == "enforce"  # file
    assert config.policy.stall_seconds == 4.5  # environment over file
    assert config.policy.min_kv_bytes == 0  # flag over environment
    assert config.policy.grace_seconds == 2.0  # None: flag not given
    assert config.collector.ports == (8000, 8001)


def test_environment_values_are_typed_and_lists_are_comma_separated() -> None:
    env = {
        "KVWATCH_COLLECTOR_PORTS": " 8000, 8001 ,",
        "KVWATCH_POLICY_ACTIONS": "reset,cancel",
        "KVWATCH_POLICY_DENY_CGROUPS": "/system.slice/*",
        "KVWATCH_HOOK_ALLOWED_UIDS": "",
        "KVWATCH_AUDIT_PATH": "",
        "KVWATCH_HTTP_LISTEN": "[::1]:9500",
    }
    config = load_config(None, env, {})
    assert config.collector.ports == (8000, 8001)
    assert config.policy.actions == ("reset", "cancel")
    assert config.policy.deny_cgroups == ("/system.slice/*",)
    assert config.hook.allowed_uids == ()
    assert config.audit.path == ""
    assert (config.http.host, config.http.port) == ("::1", 9500)


def test_variables_of_other_sections_are_not_ours() -> None:
    env = {"KVWATCH_ENGINE_SOCKET": "/tmp/x.sock", "KVWATCH_REQUIRE_BPF": "1", "HOME": "/root"}
    assert load_config(None, env, {}) == AgentConfig()


def test_a_mistyped_variable_of_our_sections_is_an_error_with_a_suggestion() -> None:
    message = error_of(env={"KVWATCH_POLICY_STALL_SECOND": "3"})
    assert "unknown environment variable KVWATCH_POLICY_STALL_SECOND" in message
    assert "did you mean KVWATCH_POLICY_STALL_SECONDS?" in message


def test_unknown_keys_and_sections_in_the_file_are_errors_with_a_suggestion(
    tmp_path: Path,
) -> None:
    message = error_of(write(tmp_path, "[policy]\nstall_second = 3\n"))
    assert "unknown key policy.stall_second in" in message
    assert "did you mean policy.stall_seconds?" in message
    assert "did you mean [policy]?" in error_of(write(tmp_path, "[polcy]\nmode = 'observe'\n"))
    assert "did you mean collector.ports?" in error_of(write(tmp_path, "[policy]\nports = []\n"))
    assert "must be a table" in error_of(write(tmp_path, "policy = 3\n"))
    assert "(known: http.listen)" in error_of(write(tmp_path, "[http]\nzzzz = 1\n"))
    assert "(sections: policy, collector," in error_of(write(tmp_path, "[zzzz]\n"))
    message = error_of(env={"KVWATCH_PATH_QQQQQQ": "/x"})
    assert message.endswith("(known: KVWATCH_PATH_PROCFS, KVWATCH_PATH_SYSFS)")


def test_a_renamed_key_still_loads_under_its_old_name_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "[collector]\nsend_hook = 'kprobe'\n")
    with caplog.at_level(logging.WARNING, logger="kvwatch.config"):
        assert load_config(path, {}, {}).collector.send_mode == "kprobe"
    assert f"collector.send_hook is now collector.send_mode (in {path})" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvwatch.config"):
        config = load_config(None, {"KVWATCH_COLLECTOR_SEND_HOOK": "raw_tp"}, {})
    assert config.collector.send_mode == "raw_tp"
    assert "KVWATCH_COLLECTOR_SEND_HOOK is now KVWATCH_COLLECTOR_SEND_MODE" in caplog.text


def test_an_unknown_flag_key_is_an_error() -> None:
    assert "did you mean policy.mode?" in error_of(flags={"policy.mod": "enforce"})
    assert "(sections: policy," in error_of(flags={"mode": "enforce"})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("policy.stall_seconds", -1, "policy.stall_seconds must be > 0 seconds (got -1,"),
        ("policy.stall_seconds", "soon", "policy.stall_seconds must be a number (got 'soon',"),
        ("policy.stall_seconds", float("nan"), "must be a number (got nan,"),
        ("policy.stall_seconds", True, "must be a number (got True,"),
        ("policy.mode", "enforcing", "policy.mode must be one of observe, enforce"),
        ("policy.actions", ("cancel", "kill"), "policy.actions must be a list of any of cancel"),
        ("policy.actions", (), "policy.actions must be a non-empty list"),
        ("policy.actions", ("reset", "reset"), "without repeats"),
        ("policy.min_kv_bytes", 1.5, "policy.min_kv_bytes must be an integer (got 1.5,"),
        ("policy.min_kv_bytes", -1, "policy.min_kv_bytes must be >= 0 bytes"),
        ("policy.grace_seconds", -0.5, "policy.grace_seconds must be >= 0 seconds"),
        ("policy.max_cancels_per_minute", 0, "max_cancels_per_minute must be >= 1"),
        ("policy.deny_ports", (0,), "policy.deny_ports must be a list of ports 1..65535"),
        ("policy.allow_comms", ("",), "policy.allow_comms must be a list of non-empty glob"),
        ("collector.ports", tuple(range(1, 18)), "a list of at most 16 ports"),
        ("collector.ports", 8000, "collector.ports must be a list of integers (got 8000,"),
        ("collector.backend", "ebpf", "collector.backend must be one of auto, core, bcc, diag"),
        ("collector.send_mode", "tp", "collector.send_mode must be one of auto, fentry"),
        ("collector.pid", -3, "collector.pid must be >= 0"),
        ("collector.max_sockets", 0, "collector.max_sockets must be 1..268435456 (the kernel"),
        ("collector.max_sockets", 2**28 + 1, "the kernel's limit for a BPF hash map"),
        ("hook.socket", "engine.sock", "hook.socket must be an absolute path"),
        ("hook.allowed_uids", (-1,), "hook.allowed_uids must be a list of uids >= 0"),
        ("http.listen", "9431", "http.listen must be host:port"),
        ("http.listen", "localhost:70000", "http.listen must be host:port"),
        ("path.procfs", "proc", "path.procfs must be an absolute path"),
        ("streams.history_size", -1, "streams.history_size must be >= 0"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(
    key: str, value: object, expected: str
) -> None:
    message = error_of(flags={key: value})
    assert expected in message
    assert "from the command line" in message


def test_an_error_says_where_the_bad_value_came_from(tmp_path: Path) -> None:
    env_message = error_of(env={"KVWATCH_POLICY_STALL_SECONDS": "-1"})
    assert env_message == (
        "policy.stall_seconds must be > 0 seconds (got '-1', from $KVWATCH_POLICY_STALL_SECONDS)"
        " (change $KVWATCH_POLICY_STALL_SECONDS)"
    )
    path = write(tmp_path, "[policy]\nstall_seconds = -1\n")
    assert f"(got -1, in {path}) (edit {path})" in error_of(path)
    assert "must be an integer (got '3.0'," in error_of(env={"KVWATCH_COLLECTOR_PID": "3.0"})
    assert "must be an integer (got 3.0, in" in error_of(
        write(tmp_path, "[collector]\npid = 3.0\n")
    )


def test_an_unreadable_or_broken_file_is_a_config_error(tmp_path: Path) -> None:
    assert "cannot read config file" in error_of(str(tmp_path / "missing.toml"))
    assert "is not valid TOML" in error_of(write(tmp_path, "[policy\n"))


def test_the_effective_config_shows_as_plain_data_and_loads_back() -> None:
    config = load_config(
        None,
        {"KVWATCH_COLLECTOR_PORTS": "8000", "KVWATCH_POLICY_MODE": "enforce"},
        {"policy.actions": ("cancel", "reset"), "policy.deny_comms": ("nginx",)},
    )
    shown = config_to_dict(config)
    assert shown["collector"]["ports"] == [8000]
    assert shown["policy"]["actions"] == ["cancel", "reset"]
    flat = {f"{section}.{key}": v for section, table in shown.items() for key, v in table.items()}
    assert sorted(flat) == sorted(config_keys())
    assert load_config(None, {}, flat) == config


def test_the_stream_state_threshold_follows_the_policy() -> None:
    policy = load_config(None, {"KVWATCH_POLICY_STALL_SECONDS": "1.5"}, {}).policy
    assert policy.state_policy().stall_seconds == 1.5
    assert not policy.enforce
    assert PolicyConfig(mode="enforce").enforce


def test_choices_match_what_the_collector_accepts() -> None:
    assert "collector.backend must be one of " + ", ".join(BACKENDS) in error_of(
        flags={"collector.backend": "x"}
    )
    assert ", ".join(("auto", *SEND_MODES)) in error_of(flags={"collector.send_mode": "x"})


def test_the_documented_example_is_the_defaults_and_every_variable_is_documented(
    tmp_path: Path,
) -> None:
    text = DOCS.read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.DOTALL)
    assert example is not None
    assert load_config(write(tmp_path, example.group(1)), {}, {}) == AgentConfig()
    documented = set(re.findall(r"`(KVWATCH_[A-Z_]+)`", text))
    wanted = {env_name(key) for key in config_keys()}
    assert wanted <= documented
    renamed = {env_name(old) for old in RENAMED_KEYS}  # documented as the old names
    assert documented - wanted == {"KVWATCH_ENGINE_SOCKET", "KVWATCH_REQUIRE_BPF", *renamed}
